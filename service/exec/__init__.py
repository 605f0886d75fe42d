"""Into a running job (contract §14): exec and forward over WebSockets, relayed to the exec
endpoint of the worker that runs the node (workers/exec_endpoint.py)."""
