"""The tick on more than one device: a device mesh, the stages' partition over it into shards,
each device's stacked parts, the sharded state's packing, and many processes as one program."""
