"""GPU memory mechanics shared by the engines and the restore path: arenas (`arena`; on CUDA the VMM one in
`cuda_arena`, released and refilled at the same addresses), the CUDA-graph scratch pool (`cuda_scratch`),
weight file I/O (`weights_io`) and the weight stager that fills an arena while CRIU restores
(`weight_stager`: its plan, the engine's client, the stager's fill and its command line)."""
