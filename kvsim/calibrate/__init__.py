"""Measuring step costs on a device with PyTorch (the `kvsim[calibrate]` extra) into a profile.

Exports: measure.calibrate; validate (whole steps timed); allreduce (the tp all-reduce timed and fitted).
"""
