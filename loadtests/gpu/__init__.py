"""The GPU check's parts (`python -m loadtests.gpu_check`) and its device run, gpu_run.sh."""
