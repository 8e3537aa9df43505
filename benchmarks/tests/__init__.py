"""The tests of benchmarks/ (the benchmark, the study, their pages and results); tests/ holds the library's."""
