"""Kernel-tuning probes (GPU): configuration sweeps, register and SASS reads, miscompile checks."""
