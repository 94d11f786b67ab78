"""The benchmarks and studies users run, by area, each as ``python -m experiments.<area>.<script>`` (README.md)."""
