"""The simulation: a scenario resolved into a plan, the step loop and its clock, the scheduler
and its running and waiting requests, the step records, every policy of a plan run (in workers).

Exports: plan.resolve; runner.simulate_plan; loop.simulate; scheduler.Scheduler; router (fleets).
"""
