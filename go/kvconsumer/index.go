// Package kvconsumer keeps a KV block index from kv-event-bridge's output (format: json), with the
// same rules as the Python consumer library (consumer/kv_consumer): the ordering and dedup rule
// (Position), one engine stream's live blocks with residency counts (StreamState, which is also
// what a state bootstrap starts from), and the index across streams (Index).
//
// Records are decoded with json.Decoder.UseNumber (Decode): the bridge's default integer block
// hashes are unsigned 64-bit numbers, which a float64 (encoding/json into interface{}) rounds.
// Blocks are keyed by their 64-bit id (BlockID): the same for an int hash and its hex text
// (hash_format: hex), so a router may look up either.
package kvconsumer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
)

// Record is one decoded record of the bridge's output, or one event of a batch, or a state document.
type Record = map[string]any

// Decode reads one JSON record, keeping numbers exact (json.Number).
func Decode(body []byte) (Record, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var r Record
	if err := dec.Decode(&r); err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("not a JSON object: %.40q", body)
	}
	return r, nil
}

// Pos is where a record stands in its engine stream: (epoch, slot, sub), compared in that order.
// Slot is seq + 1 (the epoch's SourceReset at 0); Sub is the event's index + 1 (event
// granularity), 0 (a batch), or Last (an EventsLost, after every event of its seq).
type Pos struct {
	Epoch int64
	Slot  int64
	Sub   uint64
}

// Last is the Sub of an EventsLost.
const Last = math.MaxUint64

// Less reports whether p sorts before q.
func (p Pos) Less(q Pos) bool {
	if p.Epoch != q.Epoch {
		return p.Epoch < q.Epoch
	}
	if p.Slot != q.Slot {
		return p.Slot < q.Slot
	}
	return p.Sub < q.Sub
}

// Position is the ordering and dedup rule: where record stands in its stream. Deduplicate on it,
// not on (epoch, seq, index): at batch granularity a SourceReset and its epoch's first batch
// share seq 0. An event record is told by its index first (its own fields may include "events").
func Position(r Record) (Pos, error) {
	epoch, err := integer(r["epoch"])
	if err != nil {
		return Pos{}, fmt.Errorf("epoch: %w", err)
	}
	if _, ok := r["index"]; ok {
		seq, err1 := integer(r["seq"])
		index, err2 := integer(r["index"])
		if err1 != nil || err2 != nil {
			return Pos{}, fmt.Errorf("seq/index of an event record: %v %v", err1, err2)
		}
		return Pos{epoch, seq + 1, uint64(index) + 1}, nil
	}
	_, batch := r["events"]
	if !batch && r["type"] == "SourceReset" {
		return Pos{epoch, 0, 0}, nil
	}
	seq, err := integer(r["seq"])
	if err != nil {
		return Pos{}, fmt.Errorf("seq: %w", err)
	}
	if batch {
		return Pos{epoch, seq + 1, 0}, nil
	}
	return Pos{epoch, seq + 1, Last}, nil // EventsLost (seq = its to_seq)
}

// FollowsHead reports whether the message right before a head's next (given by its headers) can
// be what the head was written after: a message of the head's stream and epoch, at or below the
// head's position. Anything else (another stream's message, a later one of its own, none) means
// the sink's events are not those the head counts (a topic lost, created again and written
// since): follow the stream from its start, where the copies are skipped.
func FollowsHead(head Record, headers map[string]string) bool {
	if headers["source"] != fmt.Sprint(head["source"]) || headers["dp_rank"] != fmt.Sprint(head["dp_rank"]) {
		return false
	}
	epoch, err1 := integer(head["epoch"])
	seq, err2 := integer(head["seq"])
	if err1 != nil || err2 != nil || headers["epoch"] != strconv.FormatInt(epoch, 10) {
		return false
	}
	r := Record{}
	for k, v := range headers {
		r[k] = json.Number(v)
	}
	r["type"] = headers["type"]
	at, err := Position(r)
	return err == nil && !(Pos{epoch, seq + 1, Last}).Less(at)
}

func integer(v any) (int64, error) {
	switch n := v.(type) {
	case json.Number:
		return n.Int64()
	case float64:
		return int64(n), nil
	case int64:
		return n, nil
	case int:
		return int64(n), nil
	}
	return 0, fmt.Errorf("not an integer: %v", v)
}

// BlockID is the 64-bit id of a block hash as written: an integer (either sign), 16 hex digits
// (hash_format: hex), or the hex of a binary digest (its low 64 bits); ok is false otherwise.
func BlockID(h any) (uint64, bool) {
	switch v := h.(type) {
	case json.Number:
		s := v.String()
		if u, err := strconv.ParseUint(s, 10, 64); err == nil {
			return u, true
		}
		if i, err := strconv.ParseInt(s, 10, 64); err == nil {
			return uint64(i), true
		}
		return 0, false
	case string:
		if v == "" {
			return 0, false
		}
		if len(v) > 16 {
			for _, c := range v[:len(v)-16] {
				if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
					return 0, false
				}
			}
			v = v[len(v)-16:]
		}
		u, err := strconv.ParseUint(v, 16, 64)
		return u, err == nil
	case uint64:
		return v, true
	case int64:
		return uint64(v), true
	}
	return 0, false
}

// Key is one entry of a stream's state: (medium, group_idx, block id). Medium and Group hold the
// JSON value's text ("null" when absent).
type Key struct {
	Medium string
	Group  string
	Block  uint64
}

func text(v any) string {
	switch t := v.(type) {
	case nil:
		return "null"
	case string:
		return strconv.Quote(t)
	case json.Number:
		return t.String()
	}
	return fmt.Sprint(v)
}

// Entry is a live block of a stream: its residency count, the hash as written, and its medium.
type Entry struct {
	Hash   any // json.Number or string, as the bridge wrote it
	Medium any // string or nil
	Count  int64
	Epoch  int64
	Seq    int64
}

type version struct{ epoch, seq int64 }

func (v version) atLeast(w version) bool {
	return v.epoch > w.epoch || (v.epoch == w.epoch && v.seq >= w.seq)
}

// StreamState is one engine stream's live blocks, as Python's kv_consumer.StreamState: started
// from nothing (NewStreamState) or from a sink's state (FromState), then Apply each record.
type StreamState struct {
	Head     Record // the state head it started from (nil: none)
	Epoch    int64
	Applied  Pos
	Complete bool
	Why      string // why it is incomplete
	// Rebootstrap: a StateSeeded record was applied while incomplete (experimental engine
	// snapshots): the sink's state is complete from there on; bootstrap again.
	Rebootstrap bool
	Entries     map[Key]*Entry
	floor       map[Key]version // the version a state sweep read, per key
	ReadyAt     version
	watch       func(Key, bool)
}

// NewStreamState is a stream without state: nothing applied, nothing known.
func NewStreamState() *StreamState {
	return &StreamState{Epoch: -1, Applied: Pos{-1, 0, Last}, Why: "no state", Entries: map[Key]*Entry{}, floor: map[Key]version{}}
}

// Swept is FromState for a bootstrap's sweep. When no write overlapped it (counted), fewer
// entries of the head's generation than the head's live count means entries lost outside the
// bridge (a topic's retention, a hash trimmed by hand): the state is then incomplete, saying so.
func Swept(head Record, entries []Record, counted bool) (*StreamState, error) {
	s, err := FromState(head, entries)
	if err != nil || !counted || !s.Complete {
		return s, err
	}
	live, err := integer(head["live"])
	if err != nil {
		return s, nil
	}
	gen, _ := integer(head["gen"])
	found := int64(0)
	for _, doc := range entries {
		e, err1 := integer(doc["epoch"])
		g, err2 := integer(doc["gen"])
		if err1 == nil && err2 == nil && e == s.Epoch && g == gen {
			found++
		}
	}
	if found < live {
		s.Complete = false
		s.Why = fmt.Sprintf("the sink may have lost entries: the sink holds %d entries where the head counts %d", found, live)
	}
	return s, nil
}

// FromState starts a stream from a state head and its entry documents (a bootstrap's sweep):
// entries of another (epoch, gen) than the head's are left out, the newest version per key kept.
func FromState(head Record, entries []Record) (*StreamState, error) {
	epoch, err1 := integer(head["epoch"])
	seq, err2 := integer(head["seq"])
	gen, err3 := integer(head["gen"])
	if err1 != nil || err2 != nil || err3 != nil {
		return nil, fmt.Errorf("malformed head %v", head)
	}
	complete, _ := head["complete"].(bool)
	s := &StreamState{Head: head, Epoch: epoch, Applied: Pos{epoch, seq + 1, Last}, Complete: complete,
		Entries: map[Key]*Entry{}, floor: map[Key]version{}, ReadyAt: version{epoch, seq}}
	if !complete {
		s.Why = "incomplete state"
	}
	for _, doc := range entries {
		e, err1 := integer(doc["epoch"])
		g, err2 := integer(doc["gen"])
		q, err3 := integer(doc["seq"])
		count, _ := integer(doc["count"])
		block, _ := doc["block"].(string)
		id, err4 := strconv.ParseUint(block, 16, 64)
		if err1 != nil || err2 != nil || err3 != nil || err4 != nil || e != epoch || g != gen {
			continue // another generation (behind a clear, or a write cut short), or malformed
		}
		key := Key{text(doc["medium"]), text(doc["group_idx"]), id}
		v := version{e, q}
		if old, ok := s.floor[key]; ok && old.atLeast(v) {
			continue // newest per key
		}
		s.floor[key] = v
		if v.atLeast(s.ReadyAt) {
			s.ReadyAt = v
		}
		if count > 0 {
			s.Entries[key] = &Entry{Hash: doc["hash"], Medium: doc["medium"], Count: count, Epoch: e, Seq: q}
		} else {
			delete(s.Entries, key)
		}
	}
	return s, nil
}

// Seq is the seq of the last record applied (-1: the epoch's SourceReset, or nothing).
func (s *StreamState) Seq() int64 { return s.Applied.Slot - 1 }

// Ready reports whether a record of the newest batch a state sweep read a version of, or of a
// later one, was applied (the state is exact once that batch's other records are too).
func (s *StreamState) Ready() bool {
	return version{s.Applied.Epoch, s.Applied.Slot}.atLeast(version{s.ReadyAt.epoch, s.ReadyAt.seq + 1})
}

func (s *StreamState) clear(epoch int64, complete bool, why string) {
	if s.watch != nil {
		for k := range s.Entries {
			s.watch(k, false)
		}
	}
	s.Entries = map[Key]*Entry{}
	s.floor = map[Key]version{}
	s.Epoch, s.Complete, s.Why, s.Rebootstrap = epoch, complete, "", false
	if !complete {
		s.Why = why
	}
}

// Apply applies one record of the stream, in the order read; false when it was skipped (a copy,
// a stale epoch, already in the state, or, with a head that names its stream, another stream's).
func (s *StreamState) Apply(r Record) (bool, error) {
	pos, err := Position(r)
	if err != nil {
		return false, err
	}
	if !s.Applied.Less(pos) || pos.Epoch < s.Epoch {
		return false, nil
	}
	if src, ok := s.Head["source"]; ok && src != nil {
		if other, named := r["source"]; named && (text(other) != text(src) || text(r["dp_rank"]) != text(s.Head["dp_rank"])) {
			return false, nil // another stream's record where this one's are read (two sources sharing a subject)
		}
	}
	_, isEvent := r["index"]
	events, isBatch := r["events"].([]any)
	if pos.Sub == 0 && pos.Epoch == s.Applied.Epoch && pos.Slot > s.Applied.Slot+1 && isBatch && !isEvent {
		// At batch granularity every seq has its record, or an EventsLost that covers it: a seq
		// skipped between two records read is one the sink no longer held (trimmed unread).
		s.clear(pos.Epoch, false, fmt.Sprintf("seqs %d-%d of epoch %d missing from what the sink holds", s.Applied.Slot, pos.Slot-2, pos.Epoch))
	}
	s.Applied = pos
	epoch, seq := pos.Epoch, pos.Slot-1
	kind, _ := r["type"].(string)
	if epoch > s.Epoch && kind != "SourceReset" {
		// A newer epoch without its reset: known only if it starts at its first batch's first event.
		s.clear(epoch, pos.Slot == 1 && pos.Sub <= 1, "joined mid-stream")
	}
	switch kind {
	case "SourceReset":
		s.clear(epoch, true, "")
		return true, nil
	case "StateSeeded":
		if !s.Complete {
			s.Rebootstrap = true
			s.Why = fmt.Sprintf("the bridge re-seeded the state from an engine snapshot at (%d, %d): bootstrap again", epoch, seq)
		}
		return true, nil
	case "EventsLost":
		s.clear(epoch, false, fmt.Sprintf("seqs %v-%v of epoch %d lost (%v)", r["from_seq"], r["to_seq"], epoch, r["reason"]))
		return true, nil
	}
	if isEvent || !isBatch {
		s.event(r, epoch, seq)
		return true, nil
	}
	for _, e := range events {
		if ev, ok := e.(map[string]any); ok {
			s.event(ev, epoch, seq)
		}
	}
	return true, nil
}

func (s *StreamState) event(e Record, epoch, seq int64) {
	kind, _ := e["type"].(string)
	if kind == "AllBlocksCleared" && e["medium"] == nil {
		s.clear(epoch, true, "")
		return
	}
	stored := kind == "BlockStored"
	if kind == "BlockInactive" {
		return // a block still cached: no change
	}
	if !stored && kind != "BlockRemoved" {
		// A clear of one medium, a move between media, or a newer engine's event type: what it
		// did to the cache cannot be applied exactly (as the bridge's own state does).
		s.clear(epoch, false, fmt.Sprintf("a %s event at (%d, %d) cannot be applied: the state is unknown", kind, epoch, seq))
		return
	}
	hashes, ok := e["block_hashes"].([]any)
	if !ok {
		return
	}
	medium, group := text(e["medium"]), text(e["group_idx"])
	v := version{epoch, seq}
	for _, h := range hashes {
		id, ok := BlockID(h)
		if !ok {
			continue
		}
		key := Key{medium, group, id}
		if f, ok := s.floor[key]; ok && f.atLeast(v) {
			continue // the sweep read this key at or after this record
		}
		entry := s.Entries[key]
		if stored {
			if entry == nil {
				entry = &Entry{Hash: h, Medium: e["medium"]}
				s.Entries[key] = entry
				if s.watch != nil {
					s.watch(key, true)
				}
			}
			entry.Count++
			entry.Epoch, entry.Seq = epoch, seq
		} else if entry != nil {
			entry.Count--
			entry.Epoch, entry.Seq = epoch, seq
			if entry.Count <= 0 {
				delete(s.Entries, key)
				if s.watch != nil {
					s.watch(key, false)
				}
			}
		}
	}
}

// Stream names an engine stream.
type Stream struct {
	Source string
	DPRank int64
}

func (s Stream) String() string { return fmt.Sprintf("%s/%d", s.Source, s.DPRank) }

type held struct {
	stream Stream
	block  uint64
}

// Index is block -> the streams holding it, with per-stream residency counts and completeness.
// Not safe for concurrent use: apply records from one goroutine.
type Index struct {
	Streams                    map[Stream]*StreamState
	Holders                    map[uint64]map[Stream]bool
	held                       map[held]int
	Applied, Duplicates, Stale int
}

// NewIndex is an empty index.
func NewIndex() *Index {
	return &Index{Streams: map[Stream]*StreamState{}, Holders: map[uint64]map[Stream]bool{}, held: map[held]int{}}
}

func (x *Index) watcher(s Stream) func(Key, bool) {
	return func(k Key, on bool) {
		h := held{s, k.Block}
		if on {
			x.held[h]++
			if x.held[h] == 1 {
				if x.Holders[k.Block] == nil {
					x.Holders[k.Block] = map[Stream]bool{}
				}
				x.Holders[k.Block][s] = true
			}
			return
		}
		x.held[h]--
		if x.held[h] <= 0 {
			delete(x.held, h)
			delete(x.Holders[k.Block], s)
			if len(x.Holders[k.Block]) == 0 {
				delete(x.Holders, k.Block)
			}
		}
	}
}

// Seed starts stream from a state bootstrap: its live blocks; records at or below its head are
// then copies, and a block event no newer than the version the sweep read for its key is skipped.
func (x *Index) Seed(s Stream, state *StreamState) {
	if old := x.Streams[s]; old != nil {
		w := x.watcher(s)
		for k := range old.Entries {
			w(k, false)
		}
		old.watch = nil
	}
	state.watch = x.watcher(s)
	for k := range state.Entries {
		state.watch(k, true)
	}
	x.Streams[s] = state
}

// Apply applies one record of any stream, in the order read per stream.
func (x *Index) Apply(r Record) error {
	source, _ := r["source"].(string)
	rank, err := integer(r["dp_rank"])
	if err != nil {
		return fmt.Errorf("dp_rank: %w", err)
	}
	s := Stream{source, rank}
	state := x.Streams[s]
	if state == nil {
		state = NewStreamState()
		state.watch = x.watcher(s)
		x.Streams[s] = state
	}
	pos, err := Position(r)
	if err != nil {
		return err
	}
	if pos.Epoch < state.Epoch {
		x.Stale++
		return nil
	}
	applied, err := state.Apply(r)
	if err != nil {
		return err
	}
	if applied {
		x.Applied++
	} else {
		x.Duplicates++
	}
	return nil
}

// StreamsHolding is the streams holding a block (an int hash, or hex text), in any medium.
func (x *Index) StreamsHolding(h any) []Stream {
	id, ok := BlockID(h)
	if !ok {
		return nil
	}
	var out []Stream
	for s := range x.Holders[id] {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].String() < out[j].String() })
	return out
}

// Summary is the index in a few lines, as the Python example consumers print it.
func (x *Index) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d distinct blocks; %d records applied, %d duplicates and %d stale skipped", len(x.Holders), x.Applied, x.Duplicates, x.Stale)
	streams := make([]Stream, 0, len(x.Streams))
	for s := range x.Streams {
		streams = append(streams, s)
	}
	sort.Slice(streams, func(i, j int) bool {
		if streams[i].Source != streams[j].Source {
			return streams[i].Source < streams[j].Source
		}
		return streams[i].DPRank < streams[j].DPRank
	})
	for _, s := range streams {
		v := x.Streams[s]
		state := "complete"
		if !v.Complete {
			state = "INCOMPLETE (" + v.Why + ")"
		}
		fmt.Fprintf(&b, "\n  %s epoch %d seq %d: %d blocks, %s", s, v.Epoch, v.Seq(), len(v.Entries), state)
	}
	return b.String()
}

// Snapshot is the index as JSON (the --json output, the same as the Python examples'): hashes
// as written (exact numbers), holders keyed by block id in decimal text. For tests and small
// setups: it holds every block.
func (x *Index) Snapshot() ([]byte, error) {
	type block struct {
		Hash   any   `json:"hash"` // a json.Number stays the exact number written
		Medium any   `json:"medium"`
		Count  int64 `json:"count"`
	}
	type stream struct {
		Source   string  `json:"source"`
		DPRank   int64   `json:"dp_rank"`
		Epoch    int64   `json:"epoch"`
		Applied  [3]any  `json:"applied"`
		Complete bool    `json:"complete"`
		Why      string  `json:"why"`
		Blocks   []block `json:"blocks"`
	}
	out := struct {
		Applied    int                 `json:"applied"`
		Duplicates int                 `json:"duplicates"`
		Stale      int                 `json:"stale"`
		Streams    []stream            `json:"streams"`
		Holders    map[string][]string `json:"holders"`
	}{x.Applied, x.Duplicates, x.Stale, []stream{}, map[string][]string{}}
	for s, v := range x.Streams {
		st := stream{s.Source, s.DPRank, v.Epoch, [3]any{v.Applied.Epoch, v.Applied.Slot, v.Applied.Sub}, v.Complete, v.Why, []block{}}
		for _, e := range v.Entries {
			st.Blocks = append(st.Blocks, block{e.Hash, e.Medium, e.Count})
		}
		out.Streams = append(out.Streams, st)
	}
	for id, streams := range x.Holders {
		names := []string{}
		for s := range streams {
			names = append(names, s.String())
		}
		sort.Strings(names)
		out.Holders[strconv.FormatUint(id, 10)] = names
	}
	return json.Marshal(out)
}
