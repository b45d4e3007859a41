"""In-process reference simulator: N replicas x P stages in one process, no network."""
