"""Stage a restored engine's weights on the GPU while CRIU is still restoring the engine itself.

After a restore, an engine that released its weights before the checkpoint must copy them back (about 0.6 s
for 16 GB from a hot page cache), and it cannot start before CRIU and the CUDA restore are done (about
1.5 s). A *stager* is a small process, started by whoever starts the restore, that does the copy in that
window instead: it allocates device memory that can be shared between processes (`cuMemCreate` with a POSIX
file-descriptor handle), fills it from the safetensors files following the engine's `StagingPlan` (through
pinned buffers, or by DMA straight from the page cache with `--copy mapped`), and hands the memory's file
descriptor to the engine over a Unix socket. The engine maps that memory at its
weight arena's own virtual addresses (`cuMemImportFromShareableHandle` + `cuMemMap`), so its tensors and
CUDA graphs see the weights with no copy at all on the engine's side. When anything fails the engine is told
why (or sees the stager hang up) and refills the weights itself, as without a stager.

The plan is the engine's, and the engine is trusted less than whoever starts the stager: the stager opens
every file before it allocates anything, inside the root it is given (`--root-fd`, openat2 with
`RESOLVE_IN_ROOT`), refuses anything but regular files, and copies at most a little past the engine's own
range (`StagingPlan.check`). Whoever starts it can also bind the socket (`--listen-fd`) and drop its
privileges to the engine's user.

    python -m warmstart.gpu.weight_stager (--plan FILE | --plan-fd N) (--socket PATH | --listen-fd N)
        [--root-fd N] [--threads N] [--copy mapped|buffered]

It may be started before its plan exists: it imports cuda-python and initialises the driver while it waits
for the plan on `--plan-fd` (a restore writes it there once the snapshot is verified).

The stager needs the CUDA driver and cuda-python, not torch: it must start fast.
"""
