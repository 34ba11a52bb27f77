"""What an engine imports: the client of its sidecar and the fast session under it."""
