"""Step time: what one engine step costs, from a roofline or from measured kernel profiles.

Exports: model.make_cost_model, StepBatch, CostModel; profiles (the format); fit, generalize, accuracy.
"""
