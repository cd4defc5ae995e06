"""Communication: the groups an op spans (``Comm``) and agreement between ranks through the store.

Below the registry, the protocol and the op: it imports nothing of arnorm but errors and value types."""
