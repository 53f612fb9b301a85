"""The gateway: a gRPC front end (tandem.v1.GenerationService) driving a speculative engine."""
