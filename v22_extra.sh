export MSA_PACKAGE_DIR=$PWD/$VARIANT
for d in bf16 fp8; do
  ncu --set full -k regex:decode_attention --launch-skip 1 --launch-count 1 -o /tmp/R_$d python3 benchmarks/lab/profile_decode.py --dtype $d --batch 32 --kv 100000 --iters 2 > /tmp/ncu_$d.log 2>&1 || tail -5 /tmp/ncu_$d.log
  ncu --import /tmp/R_$d.ncu-rep --page details 2>/dev/null | grep -E "decode_attention|Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Eligible Warps|SM Frequency" | head -8
  ncu --import /tmp/R_$d.ncu-rep --page source --print-source sass --csv > /tmp/R_$d.csv 2>/dev/null
  python3 tools/lab/ncu_stalls.py /tmp/R_$d.csv --top 14 | tail -60
done
