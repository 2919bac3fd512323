/*
 * The Flink peer of the bench's `sessions` workload (compiled and run by flink_bench.py against the
 * jars of the `apache-flink` wheel in var/flink-venv; see bench/README.md, "Peers").
 *
 * Flink's Table API refuses early/late firings on session windows ("Session window doesn't support
 * EMIT strategy currently", Flink 2.3), so this is the DataStream API, all of it on the JVM:
 *
 *   landing JSONL files -> parse -> watermark = max arrival - lag -> dedup by id (first wins)
 *   -> keyBy(key) -> EventTimeSessionWindows(gap) + allowedLateness -> EarlyOnTimeLate trigger
 *   -> incremental sum + ProcessWindowFunction that retracts the key's earlier panes it replaces
 *   -> one TSV file of panes per subtask.
 *
 * The pipeline's trigger is AtWatermark(early=AfterDelay(d), late=AtCount(1)) with processing time =
 * arrival time (as the micro-batch engine sees it). Flink's processing time is the wall clock, so the
 * early timer is an event-time timer at (first arrival of the pane + d - lag): the watermark is
 * max arrival - lag, so it passes that instant exactly when the arrival clock passes arrival + d.
 *
 * Usage: FlinkSessionsBench INPUT_DIR OUT_DIR PARALLELISM GAP_MS LAG_MS EARLY_DELAY_MS LATENESS_MS
 * Prints one JSON line: wall_s (execute() call, includes the mini-cluster's start), net_runtime_s
 * (the job's own runtime as the JobManager reports it), cpu_s (this JVM's CPU time over execute(), all
 * threads: the mini-cluster's start, JIT and GC included).
 */

import java.io.BufferedWriter;
import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;

import org.apache.flink.api.common.JobExecutionResult;
import org.apache.flink.api.common.eventtime.Watermark;
import org.apache.flink.api.common.eventtime.WatermarkGenerator;
import org.apache.flink.api.common.eventtime.WatermarkOutput;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.functions.AggregateFunction;
import org.apache.flink.api.common.functions.ReduceFunction;
import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.state.ReducingState;
import org.apache.flink.api.common.state.ReducingStateDescriptor;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.connector.sink2.Sink;
import org.apache.flink.api.connector.sink2.SinkWriter;
import org.apache.flink.api.connector.sink2.WriterInitContext;
import org.apache.flink.connector.file.src.FileSource;
import org.apache.flink.connector.file.src.reader.TextLineInputFormat;
import org.apache.flink.core.fs.Path;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.windowing.ProcessWindowFunction;
import org.apache.flink.streaming.api.windowing.assigners.EventTimeSessionWindows;
import org.apache.flink.streaming.api.windowing.triggers.Trigger;
import org.apache.flink.streaming.api.windowing.triggers.TriggerResult;
import org.apache.flink.streaming.api.windowing.windows.TimeWindow;
import org.apache.flink.util.Collector;

public class FlinkSessionsBench {

    /** One landed event (a POJO, so Flink serializes it without Kryo). */
    public static class Event {
        public String id;
        public String key;
        public long value;
        public long eventMs;
        public long arrivalMs;

        public Event() {}
    }

    /** One pane: +value, or the retraction (-1) of an earlier pane of the key. */
    public static class Pane {
        public String key;
        public long start;
        public long end;
        public long value;
        public int sign;
        public boolean early;

        public Pane() {}

        Pane(String key, TimeWindow w, long value, int sign, boolean early) {
            this.key = key;
            this.start = w.getStart();
            this.end = w.getEnd();
            this.value = value;
            this.sign = sign;
            this.early = early;
        }
    }

    static long millis(String iso) {
        Instant t = Instant.parse(iso);
        return t.getEpochSecond() * 1000L + t.getNano() / 1_000_000;
    }

    /**
     * Watermark = the largest arrival seen - lag (the pipeline's processing-time policy), emitted each
     * time it has moved by STEP_MS of arrival time: driven by the input, not by the wall clock (Flink's
     * periodic emission), so one reader's panes are the same in every run.
     */
    static class ArrivalWatermarks implements WatermarkGenerator<Event> {
        static final long STEP_MS = 1000;
        private final long lag;
        private long maxArrival = Long.MIN_VALUE;
        private long emitted = Long.MIN_VALUE;

        ArrivalWatermarks(long lag) {
            this.lag = lag;
        }

        @Override
        public void onEvent(Event e, long ts, WatermarkOutput out) {
            maxArrival = Math.max(maxArrival, e.arrivalMs);
            if (emitted == Long.MIN_VALUE || maxArrival - lag >= emitted + STEP_MS) {
                emitted = maxArrival - lag;
                out.emitWatermark(new Watermark(emitted));
            }
        }

        @Override
        public void onPeriodicEmit(WatermarkOutput out) {}
    }

    /** Keeps the first event of each id. */
    static class FirstOfId extends KeyedProcessFunction<String, Event, Event> {
        private transient ValueState<Boolean> seen;

        @Override
        public void processElement(Event e, Context ctx, Collector<Event> out) throws Exception {
            if (seen == null) {
                seen = getRuntimeContext().getState(new ValueStateDescriptor<>("seen", Boolean.class));
            }
            if (seen.value() == null) {
                seen.update(true);
                out.collect(e);
            }
        }
    }

    static class Min implements ReduceFunction<Long> {
        @Override
        public Long reduce(Long a, Long b) {
            return Math.min(a, b);
        }
    }

    /** AtWatermark(early=AfterDelay(d), late=AtCount(1)), the delay on the arrival clock (see top). */
    static class EarlyOnTimeLate extends Trigger<Event, TimeWindow> {
        private final long earlyOffset; // delay - lag
        private final ReducingStateDescriptor<Long> earlyDesc =
                new ReducingStateDescriptor<>("early", new Min(), Long.class);

        EarlyOnTimeLate(long delay, long lag) {
            this.earlyOffset = delay - lag;
        }

        @Override
        public TriggerResult onElement(Event e, long ts, TimeWindow w, TriggerContext ctx) throws Exception {
            ReducingState<Long> early = ctx.getPartitionedState(earlyDesc);
            if (w.maxTimestamp() <= ctx.getCurrentWatermark()) { // late: every element fires
                dropEarly(early, ctx);
                return TriggerResult.FIRE;
            }
            ctx.registerEventTimeTimer(w.maxTimestamp());
            if (early.get() == null) {
                long at = e.arrivalMs + earlyOffset;
                early.add(at);
                ctx.registerEventTimeTimer(at);
            }
            return TriggerResult.CONTINUE;
        }

        @Override
        public TriggerResult onEventTime(long time, TimeWindow w, TriggerContext ctx) throws Exception {
            ReducingState<Long> early = ctx.getPartitionedState(earlyDesc);
            if (time == w.maxTimestamp()) { // on time
                dropEarly(early, ctx);
                return TriggerResult.FIRE;
            }
            Long at = early.get();
            if (at != null && at == time) {
                early.clear();
                return TriggerResult.FIRE;
            }
            return TriggerResult.CONTINUE;
        }

        @Override
        public TriggerResult onProcessingTime(long time, TimeWindow w, TriggerContext ctx) {
            return TriggerResult.CONTINUE;
        }

        @Override
        public boolean canMerge() {
            return true;
        }

        @Override
        public void onMerge(TimeWindow w, OnMergeContext ctx) throws Exception {
            ctx.mergePartitionedState(earlyDesc); // the earliest pending early timer of the merged panes
            if (w.maxTimestamp() > ctx.getCurrentWatermark()) {
                ctx.registerEventTimeTimer(w.maxTimestamp());
            }
            Long at = ctx.getPartitionedState(earlyDesc).get();
            if (at != null) {
                ctx.registerEventTimeTimer(at);
            }
        }

        @Override
        public void clear(TimeWindow w, TriggerContext ctx) throws Exception {
            ctx.deleteEventTimeTimer(w.maxTimestamp());
            dropEarly(ctx.getPartitionedState(earlyDesc), ctx);
        }

        private static void dropEarly(ReducingState<Long> early, TriggerContext ctx) throws Exception {
            Long at = early.get();
            if (at != null) {
                ctx.deleteEventTimeTimer(at);
                early.clear();
            }
        }
    }

    static class Sum implements AggregateFunction<Event, Long, Long> {
        @Override
        public Long createAccumulator() {
            return 0L;
        }

        @Override
        public Long add(Event e, Long acc) {
            return acc + e.value;
        }

        @Override
        public Long getResult(Long acc) {
            return acc;
        }

        @Override
        public Long merge(Long a, Long b) {
            return a + b;
        }
    }

    /**
     * Accumulating and retracting: a pane retracts the key's earlier panes of this window and of the
     * sessions merged into it (kept in per-key state: Flink allows no per-window state in merging
     * windows), then states the new sum.
     */
    static class Emit extends ProcessWindowFunction<Long, Pane, String, TimeWindow> {
        private static final MapStateDescriptor<Long, long[]> EMITTED =
                new MapStateDescriptor<>("emitted", TypeInformation.of(Long.class), TypeInformation.of(long[].class));

        @Override
        public void process(String key, Context ctx, Iterable<Long> sums, Collector<Pane> out) throws Exception {
            long value = sums.iterator().next();
            boolean early = ctx.currentWatermark() < ctx.window().maxTimestamp();
            MapState<Long, long[]> emitted = ctx.globalState().getMapState(EMITTED);
            TimeWindow w = ctx.window();
            List<Long> replaced = new ArrayList<>();
            for (Map.Entry<Long, long[]> prev : emitted.entries()) {
                long start = prev.getKey();
                long[] endValue = prev.getValue();
                if (start >= w.getStart() && endValue[0] <= w.getEnd()) {
                    out.collect(new Pane(key, new TimeWindow(start, endValue[0]), endValue[1], -1, early));
                    replaced.add(start);
                }
            }
            for (Long start : replaced) {
                emitted.remove(start);
            }
            emitted.put(w.getStart(), new long[] {w.getEnd(), value});
            out.collect(new Pane(key, w, value, 1, early));
        }
    }

    /** Panes as TSV, one file per subtask: key, start ms, end ms, value, sign, early. */
    static class PaneFiles implements Sink<Pane> {
        private final String dir;

        PaneFiles(String dir) {
            this.dir = dir;
        }

        @Override
        public SinkWriter<Pane> createWriter(WriterInitContext ctx) throws IOException {
            int index = ctx.getTaskInfo().getIndexOfThisSubtask();
            BufferedWriter file = Files.newBufferedWriter(Paths.get(dir, "panes-" + index + ".tsv"));
            return new SinkWriter<Pane>() {
                @Override
                public void write(Pane p, Context c) throws IOException {
                    file.write(p.key + "\t" + p.start + "\t" + p.end + "\t" + p.value + "\t" + p.sign + "\t"
                            + (p.early ? 1 : 0) + "\n");
                }

                @Override
                public void flush(boolean endOfInput) throws IOException {
                    file.flush();
                }

                @Override
                public void close() throws IOException {
                    file.close();
                }
            };
        }
    }

    public static void main(String[] args) throws Exception {
        String input = args[0];
        String outDir = args[1];
        int parallelism = Integer.parseInt(args[2]);
        long gap = Long.parseLong(args[3]);
        long lag = Long.parseLong(args[4]);
        long earlyDelay = Long.parseLong(args[5]);
        long lateness = Long.parseLong(args[6]);

        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment();
        env.setParallelism(parallelism);
        env.getConfig().enableObjectReuse(); // no function here mutates its input: no defensive copies
        FileSource<String> files = FileSource.forRecordStreamFormat(new TextLineInputFormat(), new Path(input)).build();
        WatermarkStrategy<Event> watermarks = WatermarkStrategy.<Event>forGenerator(c -> new ArrivalWatermarks(lag))
                .withTimestampAssigner((e, previous) -> e.eventMs);
        env.fromSource(files, WatermarkStrategy.noWatermarks(), "landing files")
                .map(new org.apache.flink.api.common.functions.RichMapFunction<String, Event>() {
                    private transient ObjectMapper json;

                    @Override
                    public Event map(String line) throws Exception {
                        if (json == null) {
                            json = new ObjectMapper();
                        }
                        JsonNode n = json.readTree(line);
                        Event e = new Event();
                        e.id = n.get("id").asText();
                        e.key = n.get("key").asText();
                        e.value = n.get("value").asLong();
                        e.eventMs = millis(n.get("event_time").asText());
                        e.arrivalMs = millis(n.get("arrival_time").asText());
                        return e;
                    }
                })
                .name("parse JSON")
                .assignTimestampsAndWatermarks(watermarks)
                .keyBy(e -> e.id)
                .process(new FirstOfId())
                .name("dedup by id")
                .keyBy(e -> e.key)
                .window(EventTimeSessionWindows.withGap(Duration.ofMillis(gap)))
                .allowedLateness(Duration.ofMillis(lateness))
                .trigger(new EarlyOnTimeLate(earlyDelay, lag))
                .aggregate(new Sum(), new Emit())
                .name("sessions: sum, early/on-time/late panes, retractions")
                .sinkTo(new PaneFiles(outDir))
                .name("pane files");

        com.sun.management.OperatingSystemMXBean os =
                (com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();
        long cpu = os.getProcessCpuTime();
        long started = System.nanoTime();
        JobExecutionResult result = env.execute("millpond-bench-flink-sessions");
        double wall = (System.nanoTime() - started) / 1e9;
        double cpuS = (os.getProcessCpuTime() - cpu) / 1e9;
        double net = result.getNetRuntime(TimeUnit.MILLISECONDS) / 1e3;
        System.out.println("{\"wall_s\": " + wall + ", \"net_runtime_s\": " + net + ", \"cpu_s\": " + cpuS + "}");
    }
}
