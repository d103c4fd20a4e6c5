"""Megatron-Core's own layers run over real gloo ranks on a CPU: one process a rank, spawned, each
putting its (rank, ...) result on a queue (the MoE, MLA and MTP harnesses' common launch)."""

import socket


def spawn(rank_fn, config) -> list[tuple]:
    """The sorted results of ``rank_fn(rank, world, port, config, results)`` on each of the
    config's ``world_size`` ranks, over a free local port."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as probe:                  # a free port for this run's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(rank_fn, args=(config.world_size, port, config, results), nprocs=config.world_size,
                       start_method="spawn")
    return sorted(results.get() for _ in range(config.world_size))


def term_table(configs, measure, formula) -> list[dict]:
    """The error table's rows (compare.term_rows) of every rank of every configuration: ``measure(config)``
    gives (rank, {term: bytes}) a rank, ``formula(spec, technique)`` the rows it is checked against."""
    from actmem_validate.compare import term_rows

    table = []
    for config in configs:
        expected = formula(config.spec, config.technique)
        for rank, named in measure(config):
            table += term_rows(config, rank, expected, named)
    return table
