"""What travels between processes: the .proto messages, the binary frame codecs and KV events."""
