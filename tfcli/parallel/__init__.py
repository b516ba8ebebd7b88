"""Past one device: per-rank training memory plans (:mod:`tfcli.dist.plan`), measurements on
torch.distributed's fake process group (:mod:`tfcli.dist.measure`), and real process groups on
the loopback interface (:mod:`tfcli.dist.launch`, :mod:`tfcli.dist.workers`).

Nothing here is imported by ``import tfcli``; torch is imported only where a function needs it.
"""
