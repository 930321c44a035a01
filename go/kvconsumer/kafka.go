package kvconsumer

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
)

// The last part of a state head's key: source/dp_rank/_head.
const headKey = "_head"

// PartitionOf is the partition (of ids, the topic's sorted partition ids) the bridge writes key
// to: murmur2, as Java's client and aiokafka's DefaultPartitioner.
func PartitionOf(key string, ids []int) int {
	return (&kafka.Murmur2Balancer{}).Balance(kafka.Message{Key: []byte(key)}, ids...)
}

// StreamOf is the engine stream (source/dp_rank) of a state record's key.
func StreamOf(key string) string {
	if strings.HasSuffix(key, "/"+headKey) {
		return key[:len(key)-len(headKey)-1]
	}
	parts := strings.Split(key, "/") // source/dp_rank/medium/group/block: medium and group hold no '/'
	if len(parts) < 4 {
		return key
	}
	return strings.Join(parts[:len(parts)-3], "/")
}

// StateLog is the state records of every stream, fed in partition order, as Python's
// kv_consumer.kafka.StateLog: per stream the newest value per key as of its last head, the head,
// and the tail (records after the last head: a state write in progress, or cut short).
type StateLog struct {
	heads   map[string][]byte
	entries map[string]map[string][]byte
	tails   map[string]map[string][]byte // nil value: a tombstone
}

// NewStateLog is an empty log.
func NewStateLog() *StateLog {
	return &StateLog{map[string][]byte{}, map[string]map[string][]byte{}, map[string]map[string][]byte{}}
}

// Add feeds one record (value nil: a tombstone).
func (l *StateLog) Add(key string, value []byte) {
	stream := StreamOf(key)
	if len(key)-len(stream) == len(headKey)+1 {
		entries := l.entries[stream]
		if entries == nil {
			entries = map[string][]byte{}
			l.entries[stream] = entries
		}
		merge(entries, l.tails[stream])
		delete(l.tails, stream)
		if value == nil {
			delete(l.heads, stream)
		} else {
			l.heads[stream] = value
		}
		return
	}
	if l.tails[stream] == nil {
		l.tails[stream] = map[string][]byte{}
	}
	l.tails[stream][key] = value
}

func merge(entries, records map[string][]byte) {
	for k, v := range records {
		if v == nil {
			delete(entries, k)
		} else {
			entries[k] = v
		}
	}
}

// Open reports whether records of stream follow its last head (a state write not finished).
func (l *StateLog) Open(stream string) bool { return len(l.tails[stream]) > 0 }

// Newest is the last head of stream and the newest value of every live key, the tail included.
func (l *StateLog) Newest(stream string) ([]byte, [][]byte) {
	entries := map[string][]byte{}
	merge(entries, l.entries[stream])
	merge(entries, l.tails[stream])
	values := make([][]byte, 0, len(entries))
	for _, v := range entries {
		values = append(values, v)
	}
	return l.heads[stream], values
}

// KafkaOptions says what FollowKafka reads.
type KafkaOptions struct {
	Brokers    []string
	Topic      string // the sink's topic (a template without {type} or {epoch})
	StateTopic string // when set: start each stream with a head there from its state (the sink's state.topic)
	Settle     time.Duration
}

func partitionIDs(conn *kafka.Conn, topic string) ([]int, error) {
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	all, err := conn.ReadPartitions() // every topic: naming one would create it on a broker with auto-create
	if err != nil {
		return nil, err
	}
	var ids []int
	for _, p := range all {
		if p.Topic == topic {
			ids = append(ids, p.ID)
		}
	}
	sort.Ints(ids)
	return ids, nil
}

// readRange feeds add the records of offsets lo..hi-1 of one partition.
func readRange(ctx context.Context, brokers []string, topic string, partition int, lo, hi int64, add func(kafka.Message)) error {
	if lo >= hi {
		return nil
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: partition, MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 200 * time.Millisecond})
	defer r.Close()
	if err := r.SetOffset(lo); err != nil {
		return err
	}
	for {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		m, err := r.ReadMessage(ctx)
		cancel()
		if err != nil {
			return fmt.Errorf("%s[%d] at offset %d: %w", topic, partition, lo, err)
		}
		if m.Offset >= hi {
			return nil
		}
		add(m)
		if m.Offset >= hi-1 {
			return nil
		}
	}
}

func offsets(ctx context.Context, brokers []string, topic string, partition int) (int64, int64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := kafka.DialLeader(ctx, "tcp", brokers[0], topic, partition)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	return conn.ReadOffsets()
}

// BootstrapKafka seeds x with every engine stream that has a head in opts.StateTopic and returns,
// per partition of opts.Topic, the offset to follow it from (the lowest head's next of its
// streams; the partition's start when none of its streams has a head). Each state partition is
// read from its start to the end offset taken first, then on while a stream's last state write
// is open (up to opts.Settle); the state's versions make the fuzzy cut exact (StreamState).
func BootstrapKafka(ctx context.Context, conn *kafka.Conn, x *Index, opts KafkaOptions) (map[int]int64, error) {
	events, err := partitionIDs(conn, opts.Topic)
	if err != nil || len(events) == 0 {
		return nil, fmt.Errorf("topic %q: no partitions (%v)", opts.Topic, err)
	}
	starts := map[int]int64{}
	for _, p := range events {
		first, _, err := offsets(ctx, opts.Brokers, opts.Topic, p)
		if err != nil {
			return nil, fmt.Errorf("%s[%d]: %w", opts.Topic, p, err)
		}
		starts[p] = first
	}
	stateParts, err := partitionIDs(conn, opts.StateTopic)
	if err != nil || len(stateParts) == 0 {
		return starts, nil // no state (yet): every partition from its start
	}
	log := NewStateLog()
	add := func(m kafka.Message) {
		var value []byte
		if len(m.Value) > 0 {
			value = m.Value
		}
		log.Add(string(m.Key), value)
	}
	deadline := time.Now().Add(opts.Settle)
	for _, p := range stateParts {
		lo, _, err := offsets(ctx, opts.Brokers, opts.StateTopic, p)
		for err == nil {
			var hi int64
			if _, hi, err = offsets(ctx, opts.Brokers, opts.StateTopic, p); err != nil {
				break
			}
			if err = readRange(ctx, opts.Brokers, opts.StateTopic, p, lo, hi, add); err != nil {
				break
			}
			lo = hi
			open := false
			for stream := range log.tails {
				open = open || (log.Open(stream) && PartitionOf(stream, stateParts) == p)
			}
			if !open || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err != nil {
			return nil, fmt.Errorf("%s[%d]: %w", opts.StateTopic, p, err)
		}
	}
	seeded := map[int]bool{}
	for stream := range log.heads {
		raw, values := log.Newest(stream)
		head, err := Decode(raw)
		if err != nil {
			continue
		}
		docs := make([]Record, 0, len(values))
		for _, v := range values {
			if d, err := Decode(v); err == nil {
				docs = append(docs, d)
			}
		}
		state, err := Swept(head, docs, !log.Open(stream))
		if err != nil {
			continue
		}
		if log.Open(stream) { // tombstones of a later record may be in: not exact before it is applied
			seq, _ := integer(head["seq"])
			if v := (version{state.Epoch, seq + 1}); v.atLeast(state.ReadyAt) {
				state.ReadyAt = v
			}
		}
		source, rank := stream, int64(0)
		if i := strings.LastIndex(stream, "/"); i >= 0 {
			source = stream[:i]
			if r, err := strconv.ParseInt(stream[i+1:], 10, 64); err == nil {
				rank = r
			}
		}
		x.Seed(Stream{source, rank}, state)
		p := PartitionOf(stream, events)
		if next, err := integer(head["next"]); err == nil {
			first, end, err := offsets(ctx, opts.Brokers, opts.Topic, p)
			if err != nil {
				return nil, fmt.Errorf("%s[%d]: %w", opts.Topic, p, err)
			}
			if next > end || (next > first && !followsHeadAt(ctx, opts, p, next-1, head)) {
				next = first // not the partition the head was written after: from its start
			}
			if !seeded[p] || next < starts[p] {
				starts[p] = next
			}
			seeded[p] = true
		}
	}
	return starts, nil
}

// followsHeadAt reports whether the record at offset of the events partition p can be the one
// head was written after (FollowsHead); false when it cannot be read within 5 s (a record gone
// from within the partition's offsets: the caller then reads from the partition's start).
func followsHeadAt(ctx context.Context, opts KafkaOptions, p int, offset int64, head Record) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	headers := map[string]string{}
	read := false
	err := readRange(ctx, opts.Brokers, opts.Topic, p, offset, offset+1, func(m kafka.Message) {
		if m.Offset == offset {
			read = true
			for _, h := range m.Headers {
				headers[h.Key] = string(h.Value)
			}
		}
	})
	return err == nil && read && FollowsHead(head, headers)
}

// FollowKafka applies every record of opts.Topic to x until ctx is done: each partition from its
// start, or, with opts.StateTopic, from where its streams' heads continue (BootstrapKafka).
// Partitions added to the topic later are not read. changed is called between records, at least
// every 100 ms.
func FollowKafka(ctx context.Context, x *Index, opts KafkaOptions, changed func()) error {
	dial, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := kafka.DialContext(dial, "tcp", opts.Brokers[0])
	cancel()
	if err != nil {
		return fmt.Errorf("kafka %s: %w", opts.Brokers[0], err)
	}
	defer conn.Close()
	var starts map[int]int64
	waiting := false
	for ctx.Err() == nil { // until the bridge has created the topic
		if opts.StateTopic != "" {
			starts, err = BootstrapKafka(ctx, conn, x, opts)
		} else {
			var ids []int
			if ids, err = partitionIDs(conn, opts.Topic); err == nil && len(ids) == 0 {
				err = fmt.Errorf("topic %q: no partitions", opts.Topic)
			}
			starts = map[int]int64{}
			for _, p := range ids {
				starts[p] = kafka.FirstOffset
			}
		}
		if err == nil {
			break
		}
		if !waiting {
			fmt.Fprintf(os.Stderr, "kvconsumer: waiting for the bridge's topic: %v\n", err)
			waiting = true
		}
		select { // 0.5 to 1.5 s apart, until ctx is done
		case <-ctx.Done():
		case <-time.After(time.Duration(500+rand.Intn(1000)) * time.Millisecond):
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	type read struct {
		m   kafka.Message
		err error
	}
	records := make(chan read, 1000) // bounded: a slow index slows the readers
	for p, start := range starts {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: opts.Brokers, Topic: opts.Topic, Partition: p, MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 200 * time.Millisecond})
		if err := r.SetOffset(start); err != nil {
			return err
		}
		go func(r *kafka.Reader) {
			defer r.Close()
			for {
				m, err := r.ReadMessage(ctx)
				select {
				case records <- read{m, err}:
				case <-ctx.Done():
					return
				}
				if err != nil {
					return
				}
			}
		}(r)
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			changed()
		case got := <-records:
			if got.err != nil {
				if errors.Is(got.err, context.Canceled) || ctx.Err() != nil {
					return ctx.Err()
				}
				return fmt.Errorf("%s: %w", opts.Topic, got.err)
			}
			if len(got.m.Value) == 0 {
				continue
			}
			r, err := Decode(got.m.Value)
			if err != nil {
				return fmt.Errorf("%s[%d] offset %d: %w", opts.Topic, got.m.Partition, got.m.Offset, err)
			}
			if err := x.Apply(r); err != nil {
				return fmt.Errorf("%s[%d] offset %d: %w", opts.Topic, got.m.Partition, got.m.Offset, err)
			}
			if len(records) == 0 {
				changed()
			}
		}
	}
}
