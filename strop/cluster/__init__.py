"""Where a run's processes live: the launchers (local ``--nproc``, torchrun, Ray), placement across
nodes, and process lifetime. Nothing below ``strop/cluster`` imports the training or serving layers."""
