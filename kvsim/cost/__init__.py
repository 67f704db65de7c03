"""Step time: what one engine step costs, from a roofline or from measured kernel profiles.

Exports: model.make_cost_model, StepBatch, CostModel; profiles (the format); fit, generalize, accuracy;
overhead (engine host time and tp communication) and overhead_fit (fitting them to measured steps).
"""
