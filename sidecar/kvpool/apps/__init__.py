"""Programs built on the layers below: the `kvpool` command, the demo, loadgen, the router API."""
