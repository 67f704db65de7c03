"""Configuration: the scenario schema, loading a scenario file, and the errors bad input raises.

Imports nothing from the simulator. Exports: scenario.load_scenario, Scenario; errors.InputError.
"""
