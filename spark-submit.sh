#!/usr/bin/env bash
# Run a recsys job on any Spark master, the supported way.
#
#   ./spark-submit.sh [--master URL] [other spark-submit options] JOB.py [job arguments]
#
#   ./spark-submit.sh jobs/nightly_recommendations.py --date 2024-05-01
#   ./spark-submit.sh --master spark://10.0.0.5:7077 --conf spark.executor.memory=8g \
#       jobs/nightly_recommendations.py --date 2024-05-01 --conf conf/production.yaml
#
# - master: --master if given, else $SPARK_MASTER, else local[*,4] (all cores; a failed task is
#   retried up to 4 times: plain local[*] never retries);
# - Spark settings: conf/spark-defaults.conf (override any with --conf key=value);
# - the recsys package is zipped and shipped to the executors with --py-files; native
#   dependencies (torch, pyarrow, numpy) must already be on the executors, or travel as a packed
#   environment: --pack builds (once per environment digest, cached in $RECSYS_PACK_CACHE or
#   ~/.cache/recsys/pack/, shared by every checkout) an archive of what the executors import from this
#   virtualenv (all of it with --deploy-mode cluster, where the driver runs from it too) and ships it with
#   --archives ARCHIVE#environment, the executors running ./environment/bin/python; --pack=ARCHIVE ships an
#   archive built before (docs/cluster.md);
# - a spark:// master that does not answer within 5 s stops the script with one line and exit 1;
# - Python: $PYSPARK_PYTHON, else this checkout's .venv, else python3;
# - output.table's metastore: its JDBC driver jars (output.metastore.jars) go on the driver's class path;
# - Spark's own logging: conf/log4j2.properties (Spark at WARN; the job's lines stay at INFO), or
#   $RECSYS_LOG4J_CONF (empty: Spark's default); java options you pass (--driver-java-options,
#   --conf spark.driver.extraJavaOptions=...) are kept and come after it, so yours win.
# Every argument is passed through quoted; the job's exit code is this script's exit code, but for a driver JVM
# that ran out of heap (Spark's 52) or a driver killed with SIGKILL (137): one line saying so, and 1.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

python="${PYSPARK_PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python="python3"; fi
fi
export PYSPARK_PYTHON="$python"
export PYSPARK_DRIVER_PYTHON="${PYSPARK_DRIVER_PYTHON:-$python}"

if [[ -n "${SPARK_HOME:-}" && -x "$SPARK_HOME/bin/spark-submit" ]]; then
  submit="$SPARK_HOME/bin/spark-submit"
  spark_home="$SPARK_HOME"
else
  spark_home="$("$python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))' 2>/dev/null)" || {
    echo "spark-submit.sh: no SPARK_HOME and pyspark is not importable by $python; run 'make venv' or set SPARK_HOME" >&2
    exit 2
  }
  submit="$spark_home/bin/spark-submit"
fi

master="${SPARK_MASTER:-local[*,4]}"
pack=""
driver_on_cluster=""    # --deploy-mode cluster: the driver runs from the packed environment too
deploy_mode_given=""    # a deploy mode on the command line wins over the properties files
properties_file=""
load_spark_defaults=""
passthrough=()
driver_java_options=""
# spark-submit options come before the job file; everything from the job file on is the job's
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    --master) [[ $# -ge 2 ]] || { echo "spark-submit.sh: --master needs a value" >&2; exit 2; }
              master="$2"; shift 2 ;;
    --master=*) master="${1#--master=}"; shift ;;
    --pack) pack="build"; shift ;;
    --pack=*) pack="${1#--pack=}"; [[ -n "$pack" ]] || { echo "spark-submit.sh: --pack= needs an archive" >&2; exit 2; }; shift ;;
    --verbose|-v|--supervise) passthrough+=("$1"); shift ;;
    --deploy-mode) [[ $# -ge 2 ]] || { echo "spark-submit.sh: --deploy-mode needs a value" >&2; exit 2; }
              deploy_mode_given=1; [[ "$2" == cluster ]] && driver_on_cluster=1
              passthrough+=("$1" "$2"); shift 2 ;;
    --deploy-mode=*) deploy_mode_given=1; [[ "${1#*=}" == cluster ]] && driver_on_cluster=1
              passthrough+=("$1"); shift ;;
    --properties-file) [[ $# -ge 2 ]] || { echo "spark-submit.sh: --properties-file needs a value" >&2; exit 2; }
              properties_file="$2"; passthrough+=("$1" "$2"); shift 2 ;;
    --properties-file=*) properties_file="${1#*=}"; passthrough+=("$1"); shift ;;
    --load-spark-defaults) load_spark_defaults=1; passthrough+=("$1"); shift ;;
    --driver-java-options) [[ $# -ge 2 ]] || { echo "spark-submit.sh: $1 needs a value" >&2; exit 2; }
              driver_java_options="$driver_java_options $2"; shift 2 ;;
    --driver-java-options=*) driver_java_options="$driver_java_options ${1#*=}"; shift ;;
    --conf) if [[ $# -ge 2 && "$2" == spark.driver.extraJavaOptions=* ]]; then
              driver_java_options="$driver_java_options ${2#*=}"; shift 2
            else
              [[ $# -ge 2 ]] || { echo "spark-submit.sh: --conf needs a value" >&2; exit 2; }
              [[ "$2" == spark.submit.deployMode=* ]] && deploy_mode_given=1
              [[ "$2" == spark.submit.deployMode=cluster ]] && driver_on_cluster=1
              passthrough+=("$1" "$2"); shift 2
            fi ;;
    --*=*) passthrough+=("$1"); shift ;;
    *) [[ $# -ge 2 ]] || { echo "spark-submit.sh: $1 needs a value" >&2; exit 2; }
       passthrough+=("$1" "$2"); shift 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: spark-submit.sh [--master URL] [spark-submit options] JOB.py [job arguments]" >&2
  exit 2
fi

# The deploy mode may also come from a properties file (--properties-file, else spark-defaults.conf under
# SPARK_CONF_DIR or SPARK_HOME/conf, both with --load-spark-defaults), as spark-submit reads them: a driver
# on the cluster needs the whole environment packed, whichever place said so.
deploy_mode_in() {   # the spark.submit.deployMode a properties file sets, if any (key=value, key:value, key value)
  [[ -f "$1" ]] || return 0
  sed -nE 's/^[[:space:]]*spark\.submit\.deployMode[[:space:]]*[=:[:space:]][[:space:]]*([A-Za-z]+)[[:space:]]*$/\1/p' "$1" | tail -n 1
}
if [[ -z "$deploy_mode_given" ]]; then
  mode=""
  [[ -z "$properties_file" ]] || mode="$(deploy_mode_in "$properties_file")"
  if [[ -z "$mode" && ( -z "$properties_file" || -n "$load_spark_defaults" ) && -n "${spark_home:-}" ]]; then
    mode="$(deploy_mode_in "${SPARK_CONF_DIR:-$spark_home/conf}/spark-defaults.conf")"
  fi
  [[ "$mode" == cluster ]] && driver_on_cluster=1
fi

# A standalone master that does not answer costs a minute of Spark's registration retries: ask first.
if [[ "$master" == spark://* ]]; then
  IFS=',' read -ra masters <<< "${master#spark://}"
  reachable=""
  for hostport in "${masters[@]}"; do
    if timeout 5 bash -c 'exec 3<>"/dev/tcp/${1%:*}/${1##*:}"' _ "$hostport" 2>/dev/null; then reachable=1; break; fi
  done
  if [[ -z "$reachable" ]]; then
    echo "spark-submit.sh: cannot reach the Spark master $master (no answer within 5 s); check --master or SPARK_MASTER and that the master is running" >&2
    exit 1
  fi
fi

packed=()
if [[ -n "$pack" ]]; then
  if [[ "$master" == local* ]]; then
    echo "spark-submit.sh: --pack ignored with master $master: local workers run $python" >&2
  else
    pack_args=()    # the cache: $RECSYS_PACK_CACHE, else ~/.cache/recsys/pack (recsys.spark.packing)
    [[ "$pack" == "build" ]] || pack_args+=(--archive "$pack")
    [[ -z "$driver_on_cluster" ]] || pack_args+=(--whole)   # the driver needs MLflow and the rest too
    archive="$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m recsys.spark.packing ${pack_args[@]+"${pack_args[@]}"})" || exit $?
    packed=(--archives "$archive#environment" --conf "spark.pyspark.python=./environment/bin/python"
            --conf "spark.pyspark.driver.python=$PYSPARK_DRIVER_PYTHON")
  fi
fi

# The metastore of output.table: its JDBC driver on the driver's class path and derby.log under
# output.metastore.dir, from the job's own --conf/--set (the JVM starts before the job reads them).
# A configuration the job would refuse adds nothing here: the job itself then says what is wrong.
metastore_classpath=()
if settings="$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m recsys.spark.metastore "${@:2}" 2>/dev/null)"; then
  while IFS= read -r line; do
    case "$line" in
      JAVA=*) driver_java_options="$driver_java_options ${line#JAVA=}" ;;
      CLASSPATH=*) metastore_classpath=(--driver-class-path "${line#CLASSPATH=}") ;;
    esac
  done <<< "$settings"
fi

log4j_conf="${RECSYS_LOG4J_CONF-$here/conf/log4j2.properties}"
if [[ -n "$log4j_conf" ]]; then
  [[ -f "$log4j_conf" ]] || { echo "spark-submit.sh: RECSYS_LOG4J_CONF=$log4j_conf is not a file" >&2; exit 2; }
  driver_java_options="-Dlog4j2.configurationFile=file:$(cd "$(dirname "$log4j_conf")" && pwd)/$(basename "$log4j_conf")$driver_java_options"
fi
driver_java_options="${driver_java_options# }"

workdir="$(mktemp -d "${TMPDIR:-/tmp}/recsys-submit.XXXXXX")"
trap 'rm -rf "$workdir"' EXIT
# Directory entries are written too: zipimport finds a package without __init__.py (a namespace
# package; every recsys package has one today, this keeps a new one from breaking) only through
# its directory entry; without it the import falls through to whatever recsys is installed.
(cd "$here" && "$python" - "$workdir/recsys.zip" <<'PY'
import pathlib, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED) as z:
    for path in [pathlib.Path("recsys"), *sorted(pathlib.Path("recsys").rglob("*"))]:
        if "__pycache__" not in path.parts and (path.is_file() or path.is_dir()):
            z.write(path)
PY
)

set +e
"$submit" \
  --master "$master" \
  --properties-file "$here/conf/spark-defaults.conf" \
  --conf "spark.pyspark.python=$PYSPARK_PYTHON" \
  --py-files "$workdir/recsys.zip" \
  "${packed[@]+"${packed[@]}"}" \
  ${driver_java_options:+--driver-java-options "$driver_java_options"} \
  "${metastore_classpath[@]+"${metastore_classpath[@]}"}" \
  "${passthrough[@]+"${passthrough[@]}"}" \
  "$@"
status=$?
set -e
if [[ $status -eq 52 ]]; then   # SparkExitCode.OOM: the driver's JVM died of java.lang.OutOfMemoryError, which
  # leaves the job's Python no way to say so (its output goes through that JVM); 1, as any infrastructure failure
  echo "spark-submit.sh: the Spark driver's JVM ran out of Java heap (java.lang.OutOfMemoryError, exit code 52):" \
       "give it more with --driver-memory or spark.driver.memory (2g in conf/spark-defaults.conf); exit code 1" >&2
  status=1
elif [[ $status -eq 137 ]]; then   # 128 + SIGKILL: the driver's JVM was killed, or its Python process was (the JVM's
  # PythonRunner exits with the child's 137): most often the kernel's out-of-memory killer, which leaves no line
  echo "spark-submit.sh: the job's driver (its Spark JVM or its Python process) was killed with SIGKILL (exit code" \
       "137): most often the machine's or container's memory limit (the kernel's out-of-memory killer, which dmesg" \
       "names): give the driver more memory (--driver-memory) or the container a larger limit; exit code 1" >&2
  status=1
fi
exit $status
