"""The op and its call path: arguments to a problem, the communicator, the checked call, the custom op."""
