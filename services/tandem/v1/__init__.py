"""Generated gRPC code for the tandem.v1 wire contract (protos/tandem/v1); regenerate with scripts/gen_protos.py."""
