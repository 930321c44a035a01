package kvconsumer

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// rec decodes a record written as JSON, as the consumers read them.
func rec(t *testing.T, format string, args ...any) Record {
	t.Helper()
	r, err := Decode([]byte(fmt.Sprintf(format, args...)))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func batch(epoch, seq int, events string) string {
	return fmt.Sprintf(`{"source":"e","dp_rank":0,"epoch":%d,"seq":%d,"ts":1.0,"events":[%s]}`, epoch, seq, events)
}

func stored(medium string, hashes ...string) string {
	return fmt.Sprintf(`{"type":"BlockStored","block_hashes":[%s],"parent_block_hash":null,"medium":%q}`, strings.Join(hashes, ","), medium)
}

func removed(medium string, hashes ...string) string {
	return fmt.Sprintf(`{"type":"BlockRemoved","block_hashes":[%s],"medium":%q}`, strings.Join(hashes, ","), medium)
}

// applier applies records to x, failing the test at the first error.
func applier(t *testing.T, x *Index) func(Record) {
	return func(r Record) {
		t.Helper()
		if err := x.Apply(r); err != nil {
			t.Fatal(err)
		}
	}
}

// residency is a stream's (hash, medium) -> count, as text.
func residency(x *Index, s Stream) map[string]int64 {
	out := map[string]int64{}
	for _, e := range x.Streams[s].Entries {
		out[fmt.Sprintf("%v/%v", e.Hash, e.Medium)] += e.Count
	}
	return out
}

func same(t *testing.T, got, want map[string]int64) {
	t.Helper()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// The rules of tests/integration/test_example_consumers.py::test_index_rules, on the Go index.
func TestIndexRules(t *testing.T) {
	x := NewIndex()
	e := Stream{"e", 0}
	apply := applier(t, x)
	apply(rec(t, batch(10, 0, stored("GPU", "1", "2")+","+stored("GPU", "1")+","+stored("CPU", "2"))))
	apply(rec(t, batch(10, 1, removed("GPU", "1")+","+removed("CPU", "2"))))
	same(t, residency(x, e), map[string]int64{"1/GPU": 1, "2/GPU": 1})
	apply(rec(t, batch(10, 1, removed("GPU", "1")+","+removed("CPU", "2"))))
	apply(rec(t, batch(10, 2, stored("GPU", "3")+","+removed("GPU", "1"))))
	apply(rec(t, batch(10, 1, removed("GPU", "1"))))
	same(t, residency(x, e), map[string]int64{"2/GPU": 1, "3/GPU": 1})
	if x.Duplicates != 2 || len(x.StreamsHolding(json.Number("3"))) != 1 || len(x.StreamsHolding("0000000000000003")) != 1 {
		t.Fatalf("duplicates %d, holders of 3: %v", x.Duplicates, x.StreamsHolding(json.Number("3")))
	}
	// event granularity
	g := Stream{"g", 0}
	for _, p := range [][2]int{{0, 0}, {0, 1}, {1, 0}, {0, 1}} {
		body := stored("GPU", "3")
		if p == [2]int{1, 0} {
			body = removed("GPU", "3")
		}
		apply(rec(t, `{"source":"g","dp_rank":0,"epoch":10,"seq":%d,"index":%d,"ts":1.0,%s`, p[0], p[1], body[1:]))
	}
	same(t, residency(x, g), map[string]int64{"3/GPU": 1})
	if x.Duplicates != 3 || len(x.StreamsHolding(json.Number("3"))) != 2 {
		t.Fatalf("duplicates %d", x.Duplicates)
	}
	// a loss
	apply(rec(t, `{"source":"e","dp_rank":0,"epoch":10,"seq":5,"type":"EventsLost","from_seq":3,"to_seq":5,"count":3,"reason":"replay_buffer_exceeded"}`))
	apply(rec(t, batch(10, 6, stored("GPU", "4")+","+removed("GPU", "2"))))
	same(t, residency(x, e), map[string]int64{"4/GPU": 1})
	if x.Streams[e].Complete || x.Streams[e].Why != "seqs 3-5 of epoch 10 lost (replay_buffer_exceeded)" {
		t.Fatalf("why: %q", x.Streams[e].Why)
	}
	// the bridge re-seeded the sink's state from an engine snapshot (experimental): bootstrap again
	apply(rec(t, `{"source":"e","dp_rank":0,"epoch":10,"seq":6,"type":"StateSeeded","cut":5,"design":"vllm-57789"}`))
	same(t, residency(x, e), map[string]int64{"4/GPU": 1})
	if x.Streams[e].Complete || !x.Streams[e].Rebootstrap || !strings.Contains(x.Streams[e].Why, "at (10, 6): bootstrap again") {
		t.Fatalf("after StateSeeded: complete %v, rebootstrap %v, why %q", x.Streams[e].Complete, x.Streams[e].Rebootstrap, x.Streams[e].Why)
	}
	apply(rec(t, batch(10, 7, `{"type":"AllBlocksCleared"},`+stored("GPU", "5"))))
	same(t, residency(x, e), map[string]int64{"5/GPU": 1})
	if !x.Streams[e].Complete {
		t.Fatal("not complete after a clear")
	}
	// a restart; the old epoch's late records are stale
	apply(rec(t, `{"source":"e","dp_rank":0,"epoch":11,"seq":0,"type":"SourceReset","reason":"publisher_restart"}`))
	apply(rec(t, batch(11, 0, stored("GPU", "6"))))
	apply(rec(t, batch(10, 8, stored("GPU", "7"))))
	same(t, residency(x, e), map[string]int64{"6/GPU": 1})
	if x.Stale != 1 {
		t.Fatalf("stale %d", x.Stale)
	}
	// the bridge restarted: the same SourceReset and records again
	apply(rec(t, `{"source":"e","dp_rank":0,"epoch":11,"seq":0,"type":"SourceReset","reason":"bridge_restart"}`))
	apply(rec(t, batch(11, 0, stored("GPU", "6"))))
	apply(rec(t, batch(11, 1, stored("GPU", "8"))))
	same(t, residency(x, e), map[string]int64{"6/GPU": 1, "8/GPU": 1})
	if x.Duplicates != 5 {
		t.Fatalf("duplicates %d", x.Duplicates)
	}
	// a newer epoch without a SourceReset
	apply(rec(t, batch(12, 0, stored("GPU", "9"))))
	if !x.Streams[e].Complete {
		t.Fatal("epoch 12 from seq 0 is complete")
	}
	apply(rec(t, batch(13, 4, stored("GPU", "10"))))
	if x.Streams[e].Complete || x.Streams[e].Why != "joined mid-stream" {
		t.Fatalf("why: %q", x.Streams[e].Why)
	}
	if !strings.HasPrefix(x.Summary(), "2 distinct blocks") {
		t.Fatal(x.Summary())
	}
	// a batch record carrying its type (schema_version 2): still a batch, after its epoch's reset
	apply(rec(t, `{"source":"e","dp_rank":0,"epoch":14,"seq":0,"type":"SourceReset","reason":"publisher_restart"}`))
	apply(rec(t, `{"source":"e","dp_rank":0,"epoch":14,"seq":0,"type":"EventBatch","ts":1.0,"events":[%s]}`, stored("GPU", "11")))
	same(t, residency(x, e), map[string]int64{"11/GPU": 1})
	if !x.Streams[e].Complete {
		t.Fatal(x.Summary())
	}
}

// Unsigned 64-bit hashes stay exact (a float64 would round them), and an int hash and its hex
// text are the same block.
func TestU64Hashes(t *testing.T) {
	x := NewIndex()
	big := "18446744073709551557" // 2^64 - 59
	if err := x.Apply(rec(t, batch(1, 0, stored("GPU", big, "18446744073709551556")))); err != nil {
		t.Fatal(err)
	}
	if len(x.StreamsHolding(json.Number(big))) != 1 || len(x.StreamsHolding("ffffffffffffffc5")) != 1 {
		t.Fatal("the u64 hash is not held exactly")
	}
	if len(x.Streams[Stream{"e", 0}].Entries) != 2 {
		t.Fatal("two hashes one apart were merged")
	}
	if id, ok := BlockID(json.Number("-1")); !ok || id != 1<<64-1 {
		t.Fatal("a negative (int64) hash is its two's complement")
	}
}

// An engine field named "events" does not make an event record a batch.
func TestEventRecordWithAnEventsField(t *testing.T) {
	x := NewIndex()
	head := `"source":"e","dp_rank":0,"epoch":5,"ts":1.0,"schema_version":1`
	_ = x.Apply(rec(t, `{%s,"seq":0,"index":0,"type":"BlockStored","block_hashes":[42],"medium":"GPU"}`, head))
	_ = x.Apply(rec(t, `{%s,"seq":1,"index":0,"type":"BlockRemoved","block_hashes":[42],"medium":"GPU","events":[]}`, head))
	if len(x.StreamsHolding(json.Number("42"))) != 0 || !x.Streams[Stream{"e", 0}].Complete {
		t.Fatal(x.Summary())
	}
}

// A sweep that no write overlapped and that holds fewer entries of the head's generation than
// the head counts is incomplete (entries lost outside the bridge); one that a write overlapped
// cannot be counted.
func TestSweptCountsTheHeadsEntries(t *testing.T) {
	head := rec(t, `{"source":"e","dp_rank":0,"epoch":1,"gen":2,"seq":5,"complete":true,"live":2}`)
	entry := func(block string) Record {
		return rec(t, `{"medium":"GPU","group_idx":0,"block":%q,"count":1,"epoch":1,"gen":2,"seq":3}`, block)
	}
	whole, err := Swept(head, []Record{entry("01"), entry("02")}, true)
	if err != nil || !whole.Complete {
		t.Fatalf("a whole sweep: %v %v", whole, err)
	}
	short, err := Swept(head, []Record{entry("01")}, true)
	if err != nil || short.Complete || !strings.Contains(short.Why, "holds 1 entries where the head counts 2") {
		t.Fatalf("a short sweep: %+v %v", short, err)
	}
	overlapped, err := Swept(head, []Record{entry("01")}, false)
	if err != nil || !overlapped.Complete {
		t.Fatalf("an overlapped sweep: %+v %v", overlapped, err)
	}
}

// At batch granularity every seq has a record, or an EventsLost covering it: a seq skipped between
// two batch records is one the sink lost before it was read, so the stream is incomplete and its
// blocks dropped, as for an EventsLost. Event records are not checked (a batch whose events were
// all filtered out has none).
func TestASeqMissingBetweenBatchRecordsMakesTheStreamIncomplete(t *testing.T) {
	x := NewIndex()
	e := Stream{"e", 0}
	apply := applier(t, x)
	apply(rec(t, batch(7, 0, stored("GPU", "1"))))
	apply(rec(t, batch(7, 3, stored("GPU", "2"))))
	if s := x.Streams[e]; s.Complete || s.Why != "seqs 1-2 of epoch 7 missing from what the sink holds" {
		t.Fatalf("why: %q", s.Why)
	}
	same(t, residency(x, e), map[string]int64{"2/GPU": 1})
	head := `"source":"f","dp_rank":0,"epoch":5,"ts":1.0,"schema_version":1`
	apply(rec(t, `{%s,"seq":0,"index":0,"type":"BlockStored","block_hashes":[42],"medium":"GPU"}`, head))
	apply(rec(t, `{%s,"seq":4,"index":0,"type":"BlockStored","block_hashes":[43],"medium":"GPU"}`, head))
	if !x.Streams[Stream{"f", 0}].Complete {
		t.Fatal(x.Summary())
	}
}

// Two sources whose names give one subject interleave their records there until the bridge
// notices: a state whose head names its stream applies only that stream's records.
func TestAStateAppliesOnlyTheRecordsOfTheStreamItsHeadNames(t *testing.T) {
	head := rec(t, `{"source":"llama.a","dp_rank":0,"epoch":3,"gen":0,"seq":5,"complete":true,"live":0}`)
	s, err := FromState(head, nil)
	if err != nil {
		t.Fatal(err)
	}
	other := rec(t, `{"source":"llama_a","dp_rank":0,"epoch":3,"seq":6,"events":[%s]}`, stored("GPU", "1"))
	rank := rec(t, `{"source":"llama.a","dp_rank":1,"epoch":3,"seq":6,"events":[%s]}`, stored("GPU", "1"))
	mine := rec(t, `{"source":"llama.a","dp_rank":0,"epoch":3,"seq":6,"events":[%s]}`, stored("GPU", "2"))
	for _, r := range []Record{other, rank} {
		if applied, _ := s.Apply(r); applied {
			t.Fatalf("applied %v", r)
		}
	}
	if applied, _ := s.Apply(mine); !applied || len(s.Entries) != 1 || !s.Complete {
		t.Fatalf("mine: %v %+v", applied, s)
	}
}

// A newer engine's event type, or a clear of one medium, may change the cache in a way the
// consumer cannot apply: the stream's state is unknown (incomplete) until its next full clear.
func TestAnEventTheConsumerCannotApplyMakesTheStreamIncomplete(t *testing.T) {
	for _, event := range []string{`{"type":"SomethingNew","block_hashes":[1]},`, `{"type":"AllBlocksCleared","medium":"CPU"},`} {
		x := NewIndex()
		e := Stream{"e", 0}
		apply := applier(t, x)
		apply(rec(t, batch(7, 0, stored("GPU", "1"))))
		apply(rec(t, batch(7, 1, `{"type":"BlockInactive","block_hashes":[1]},`+stored("GPU", "2"))))
		if s := x.Streams[e]; !s.Complete {
			t.Fatalf("BlockInactive changes nothing: %q", s.Why)
		}
		apply(rec(t, batch(7, 2, event+stored("GPU", "3"))))
		if s := x.Streams[e]; s.Complete || !strings.Contains(s.Why, "cannot be applied") {
			t.Fatalf("%s: complete %v, why %q", event, s.Complete, s.Why)
		}
		same(t, residency(x, e), map[string]int64{"3/GPU": 1})
		apply(rec(t, batch(7, 3, `{"type":"AllBlocksCleared"},`+stored("GPU", "4"))))
		if s := x.Streams[e]; !s.Complete {
			t.Fatalf("a full clear: %q", s.Why)
		}
	}
}

func TestFollowsHeadOnlyForAMessageOfTheHeadsStreamAtOrBelowIt(t *testing.T) {
	head := rec(t, `{"source":"a","dp_rank":0,"epoch":7,"gen":1,"seq":19,"live":3,"complete":true,"next":80}`)
	msg := func(source, rank, epoch, seq, kind string) map[string]string {
		return map[string]string{"source": source, "dp_rank": rank, "epoch": epoch, "seq": seq, "type": kind}
	}
	for _, c := range []struct {
		headers map[string]string
		want    bool
	}{
		{msg("a", "0", "7", "19", "EventBatch"), true},
		{msg("a", "0", "7", "12", "EventBatch"), true}, // a batch with no event at event granularity leaves none
		{msg("a", "0", "7", "19", "EventsLost"), true},
		{msg("a", "0", "7", "20", "EventBatch"), false}, // a later one: another stream's copy, written since
		{msg("b", "0", "7", "19", "EventBatch"), false},
		{msg("a", "1", "7", "19", "EventBatch"), false},
		{msg("a", "0", "6", "19", "EventBatch"), false},
		{map[string]string{}, false},
	} {
		if got := FollowsHead(head, c.headers); got != c.want {
			t.Errorf("FollowsHead(%v) = %v, want %v", c.headers, got, c.want)
		}
	}
	reset := rec(t, `{"source":"a","dp_rank":0,"epoch":8,"gen":1,"seq":-1,"live":0,"complete":true,"next":81}`)
	if !FollowsHead(reset, msg("a", "0", "8", "0", "SourceReset")) {
		t.Error("the SourceReset a reset's head was written after")
	}
}
