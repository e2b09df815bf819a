"""A two-node Ray cluster on 127.0.0.1 for tests/write/test_ray_engine.py: ``python ray_cluster.py TEMP``.

Starts a head and a second node (one CPU each) with Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``,
documented by Ray for testing several nodes on one machine), prints the head's address (``127.0.0.1:PORT``) on one
line, and keeps the cluster up until its standard input closes. Every Ray process of both nodes is a descendant of
this one, so the test ends them all by ending this process's tree.

``ray start --address 127.0.0.1:P`` cannot be used for the second node: Ray rewrites a loopback address to the
machine's interface address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and ``ray start`` refuses to join a
cluster with that setting. The test's environment sets it (and the rest of :func:`test_ray_engine.ray_env`) before
Ray is imported here.
"""

from __future__ import annotations

import os
import sys


def main(temp: str) -> None:
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        sys.exit("ray_cluster.py: run it with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (see its docstring)")
    # Ray writes the cluster's address into RAY_TMPDIR/ray; it must exist
    os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 1, "include_dashboard": False, "temp_dir": temp, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    sys.stdin.read()  # until the test closes the pipe (or dies)
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
