"""The convergence study of issue 9: compressed against uncompressed training, several tasks,
optimizers and seeds, on 2 ranks. ``make study`` runs it and writes benchmarks/results/STUDY.md."""
