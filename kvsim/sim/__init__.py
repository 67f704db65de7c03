"""The simulation: the step loop on SimPy's clock, the scheduler and its running and waiting requests,
the step records, and the runner that takes a scenario through every policy (in worker processes).

Exports: runner.run_scenario; loop.simulate; scheduler.Scheduler; router (fleets).
"""
