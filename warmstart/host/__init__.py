"""Host helpers below everything else: files (`fileio`), processes (`procinfo`), the clock, parallel I/O
(`parallel`) and the CUDA driver's bindings (`cuda_driver`). They import nothing of warmstart."""
