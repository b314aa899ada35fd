"""The HTTP benchmark's parts (`python -m loadtests.bench`, the locust file, soak):
requests and their streams, metrics, datasets, the servers they start."""
