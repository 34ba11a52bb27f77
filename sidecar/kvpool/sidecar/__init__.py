"""The sidecar: local tier, pool fan-out and the unix-socket server the engine's client uses."""
