"""Benchmarks; the figures live in bench/RESULTS.md (newest first), the plots in bench/figures/.

    python -m bench.run_all            # every harness figure, ~30 min on 2 CPU cores (--quick: smoke sizes)
    python -m bench.questions Q --preset P    # one question: dp-cost, lora, opacus, self-check
    python -m bench.overhead           # where a small model's DP step goes (phases, fixed costs)
    python -m bench.scale suite        # real configurations' slices: memory per rank, step time
    python -m bench.gpu_check          # on a machine with CUDA: parity, two devices, the harness

Older single-purpose tools: bench.qps (QPS and memory over micro-batch counts), bench.cpu_time,
bench.memory_sweep, bench.checkpoint_memory, bench.schedule_sim, and pytest-benchmark micro-benchmarks
in bench/test_bench_norms.py.
"""
