"""The gateway: a gRPC front end (tandem.v1.Generation) driving a speculative engine."""
