"""The tick on more than one device, or faster on one: stacked runs of identical stages, a device
mesh, the stages' partition over it, the sharded state's packing, and multi-process start-up."""
