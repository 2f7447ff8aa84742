# Sourced by the GPU-machine scripts: puts the driver's libcuda and NVRTC on LD_LIBRARY_PATH (toolkit first,
# then any pip wheel).
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
if ! ls $(echo "${LD_LIBRARY_PATH:-}" | tr : " ") 2>/dev/null | grep -q libnvrtc.so; then
  n=$(find / -name 'libnvrtc.so.1[23]' -not -path '/proc/*' 2>/dev/null | head -1)
  [ -n "$n" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$n")"
fi
export LD_LIBRARY_PATH
