"""The shared speculative core: sampling, acceptance, adaptive policy, model runners and the round loop."""
