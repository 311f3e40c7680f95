"""Planners: pure functions from sequence lengths, a cost model and a cluster spec to plans.

Nothing here imports a training framework or touches a device.
"""
