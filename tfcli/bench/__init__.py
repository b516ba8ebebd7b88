"""`tfcli bench`: attention alone and the configured model across sequence lengths, kernels,
devices and dtypes; time, peak memory, FLOP/s and fitted scaling exponents."""
