"""What a user runs to measure a server: the load generator (``python -m batchgate.bench``), quick,
text_batches, variants, goodput, engines, the GPU check and plots. Each prints its figures as ratios
measured in one run (the machine is shared). Lab equipment (profilers, experiments) is in the
checkout's ``lab/``, not in the wheel."""
