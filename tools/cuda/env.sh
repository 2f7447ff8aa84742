# Sourced by the GPU-machine scripts (verify.sh, ab.sh, same.sh, knockout.sh): the CUDA libraries on
# LD_LIBRARY_PATH, the work folder W, and the seed-0 test checkpoints made there on first use.

# The driver's libcuda and NVRTC: toolkit first, then any pip wheel.
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
if ! ls $(echo "${LD_LIBRARY_PATH:-}" | tr : " ") 2>/dev/null | grep -q libnvrtc.so; then
  n=$(find / -name 'libnvrtc.so.1[23]' -not -path '/proc/*' 2>/dev/null | head -1)
  [ -n "$n" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$n")"
fi
export LD_LIBRARY_PATH

W=/tmp/deltafin-cuda-verify; mkdir -p "$W"

# checkpoint BINARY ARCH PRESET [QUANT]: prints the folder of that checkpoint (QUANT: make-model's --quant, for
# deepseek_v3 and kimi_k2), made by BINARY if it is not there yet (the bench preset takes about a minute; given
# 70 s, it is missing afterwards if that ran out).
checkpoint() {
  local m=$W/$2-$3${4:+-$4}
  [ -f "$m/config.json" ] || timeout 70 "$1" make-model --arch "$2" --preset "$3" ${4:+--quant "$4"} --seed 0 --out "$m" >/dev/null 2>&1
  echo "$m"
}
