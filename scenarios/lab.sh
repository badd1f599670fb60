#!/usr/bin/env bash
# One lab of the course, end to end: run its scenarios, then compare them (a table and one plot).
#   scenarios/lab.sh 1|2|3|4|5|links|noniid|overlap [OUT]      (OUT: runs/labN; swarmtrain on PATH, e.g. . .venv/bin/activate)
# 1: FedAvg with H = 1, 4, 16, 64 at one token budget; 2: DiLoCo vs FedAvg vs synchronous data parallel (H = 1);
# 3: the top 1 % of the update with and without error feedback vs the whole update; 4: churn, one random node
# killed every round and back the next (its run's report has the members plot); 5: batch sizes 4 to 32 on four
# nodes, each update weighted by its tokens or all alike; links: unlimited, 100 Mbit/s, 100 Mbit/s with 50 ms
# round trips, and that with 1 % loss too (needs root); noniid: nodes on different parts of the corpus, or all on
# all of it; overlap: 100 Mbit/s with 50 ms round trips, the exchange hidden behind the inner steps or not (needs
# root).
set -euo pipefail
lab=${1:-}
out=${2:-runs/lab$lab}
case $lab in
    1) runs="lab1-fedavg-h1 lab1-fedavg-h4 lab1-fedavg-h16 lab1-fedavg-h64" ;;
    2) runs="lab1-fedavg-h1 lab1-fedavg-h16 lab2-diloco-h16" ;;
    3) runs="lab2-diloco-h16 lab3-topk lab3-topk-no-ef" ;;
    4) runs="churn-drop-one" ;;
    5) runs="lab5-tokens lab5-equal" ;;
    links) runs="links-unlimited links-100mbit links-100mbit-50ms links-lossy" ;;
    noniid) runs="noniid-shuffled noniid-parts" ;;
    overlap) runs="overlap-off overlap-on" ;;
    *) echo "usage: scenarios/lab.sh 1|2|3|4|5|links|noniid|overlap [OUT]: lab 1 (FedAvg and H), 2 (DiLoCo), 3 (top-k), 4 (churn), 5 (batch), links, noniid, overlap" >&2; exit 2 ;;
esac
here=$(dirname "$0")
folders=()
for run in $runs; do
    swarmtrain scenario run "$here/$run.toml" --out "$out/$run"
    folders+=("$out/$run")
done
swarmtrain scenario compare "${folders[@]}" --out "$out/compare"
