set terminal pngcairo size 1200,640 font 'sans,11'
set output 'call_overhead.png'
set title "Wall time per call, back to back (fp16; causal but decode; B = 1 unless given)\n{/*0.8 NVIDIA H200, CUDA 13.0, 2026-11-30; the package: 00b86f6 (C++ operators)}"
set ylabel 'wall time per call (us)'
set grid ytics
set logscale y
set yrange [10:*]
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 noborder
set boxwidth 0.9
set key outside right top noenhanced
set xtics noenhanced rotate by -25
plot 'call_overhead_data/call_overhead.dat' using 2:xtic(1) title 'flash_stages, SDPA call' lc rgb '#1b9e77', \
     'call_overhead_data/call_overhead.dat' using 3:xtic(1) title 'flash_stages, FlashAttention call' lc rgb '#d95f02', \
     'call_overhead_data/call_overhead.dat' using 4:xtic(1) title 'SDPA flash' lc rgb '#7570b3', \
     'call_overhead_data/call_overhead.dat' using 5:xtic(1) title 'SDPA cudnn' lc rgb '#e7298a', \
     'call_overhead_data/call_overhead.dat' using 6:xtic(1) title 'SDPA efficient' lc rgb '#66a61e'
