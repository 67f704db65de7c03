"""The requests a run replays: arrivals, prompt and output lengths, and shared content.

Exports: requests.generate_requests and RequestSpec; datasets (presets, traces); sharing.
"""
