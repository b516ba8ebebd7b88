"""Past one device: per-rank training memory plans (:mod:`tfcli.parallel.plan`), measurements on
torch.distributed's fake process group (:mod:`tfcli.parallel.measure`), and real process groups on
the loopback interface (:mod:`tfcli.parallel.launch`, :mod:`tfcli.parallel.workers`).

Nothing here is imported by ``import tfcli``; torch is imported only where a function needs it.
"""
