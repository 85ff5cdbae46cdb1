"""The runtime: validated calls -> kernel configurations -> launch plans -> driver launches.

arrays (the caller's arrays: kind, pointers, outputs), streams, device, driver (LaunchPlan,
ctypes cuLaunchKernel), fastpath (repeated calls by signature), maskplan (mask objects ->
device inputs), and one module per operation: attention, decode, merge.
"""
