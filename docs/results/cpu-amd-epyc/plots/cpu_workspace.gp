set terminal pngcairo size 1000,640 font 'sans,11'
set output 'cpu_workspace.png'
set title "CPU stages: workspace (1 head, d = 64)\n{/*0.8 AMD EPYC, 2026-11-21}"
set xlabel 'N (sequence length)'
set ylabel 'workspace (bytes)'
set grid
set key outside right top
set logscale x 2
set logscale y
plot 'cpu_workspace_data/s0.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#1b9e77' title '00_naive' noenhanced, \
     'cpu_workspace_data/s1.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#d95f02' title '01_cpu_tiled' noenhanced, \
     'cpu_workspace_data/s2.dat' using 1:2 with linespoints lw 2 pt 7 lc rgb '#7570b3' title '02_online_softmax' noenhanced
