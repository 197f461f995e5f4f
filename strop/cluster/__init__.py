"""Where a run's processes live: the launchers (local ``--nproc`` on torch's elastic agent, torchrun's ranks as
they come, Ray actors), placement across nodes, and process lifetime. :func:`strop.cluster.launcher.start` is
the one door: the driver (strop/loop.py) never knows which launcher started it. Nothing below ``strop/cluster``
imports the training or serving layers. (Empty: strop.cluster.config is imported by a torch-free config.)"""
