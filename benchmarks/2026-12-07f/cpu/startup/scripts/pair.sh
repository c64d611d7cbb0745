# usage: pair.sh NAME DIR [DIR...]: cold start of each tree in turn
name=$1; shift
for d in "$@"; do
  tag=$(basename $d)
  echo "== $tag load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $d && python scripts/bench_startup.py --runs ${RUNS:-1} --json /tmp/res/${name}_$tag.json --log-dir /tmp/res/${name}_${tag}_logs 2>&1 | grep '"run"')
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg)"
