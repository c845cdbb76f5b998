"""raytrain benchmarks (issue #6): `python -m benchmarks.bench <p1..p8|all> [--quick | --gpu]`.

Every benchmark runs its arms as child processes of one bench process, alternating
(A B B A ...), and prints the medians, the ratio and the exact command. See README.md.
"""
