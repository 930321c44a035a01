package kvconsumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The bridge's Redis entry ids hold the record's Position in one of two layouts: narrow,
// <epoch * 2**40 + slot>-<sub> (epochs below 2**23: minutes, written by earlier releases), and
// wide, <2**63 + epoch>-<slot * 2**24 + sub> (microsecond epochs; sub 2**24-1: the slot's last).
const (
	slotBits = 40
	subBits  = 24
	wide     = uint64(1) << 63
)

// EntryPosition is the Position of a Redis entry id the bridge wrote.
func EntryPosition(id string) (Pos, error) {
	first, sub, _ := strings.Cut(id, "-")
	ms, err := strconv.ParseUint(first, 10, 64)
	if err != nil {
		return Pos{}, fmt.Errorf("entry id %q: %w", id, err)
	}
	s := uint64(0)
	if sub != "" {
		if s, err = strconv.ParseUint(sub, 10, 64); err != nil {
			return Pos{}, fmt.Errorf("entry id %q: %w", id, err)
		}
	}
	if ms&wide == 0 {
		return Pos{int64(ms >> slotBits), int64(ms & (1<<slotBits - 1)), s}, nil
	}
	low := s & (1<<subBits - 1)
	if low == 1<<subBits-1 {
		low = Last
	}
	return Pos{int64(ms &^ wide), int64(s >> subBits), low}, nil
}

// BootstrapRedis reads one engine stream's state from a Redis sink with state.enabled (the HASH
// stateKey: field _head, one field per live block): the head, every field (HSCAN), the head
// again; a clear that ran meanwhile (or a head gone back: Redis restarted from an older
// snapshot; or the stream streamKey trimmed past the head) makes it start over, up to attempts
// times. It returns the state and the entry id to follow streamKey after ("" when there is no
// state yet: follow from the stream's start, with a NewStreamState).
func BootstrapRedis(ctx context.Context, c redis.UniversalClient, stateKey, streamKey string, attempts int) (*StreamState, string, error) {
	for i := 0; i < attempts; i++ {
		raw, err := c.HGet(ctx, stateKey, "_head").Result()
		if errors.Is(err, redis.Nil) {
			return NewStreamState(), "", nil
		} else if err != nil {
			return nil, "", fmt.Errorf("%s: %w", stateKey, err)
		}
		head, err := Decode([]byte(raw))
		if err != nil {
			return nil, "", fmt.Errorf("%s: the head is not JSON: %w", stateKey, err)
		}
		fields := map[string]string{}
		var cursor uint64
		for {
			chunk, next, err := c.HScan(ctx, stateKey, cursor, "", 1000).Result()
			if err != nil {
				return nil, "", fmt.Errorf("%s: %w", stateKey, err)
			}
			for j := 0; j+1 < len(chunk); j += 2 {
				fields[chunk[j]] = chunk[j+1]
			}
			if cursor = next; cursor == 0 {
				break
			}
		}
		againRaw, err := c.HGet(ctx, stateKey, "_head").Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, "", fmt.Errorf("%s: %w", stateKey, err)
		}
		again, _ := Decode([]byte(againRaw))
		_, writing := fields["_w"]
		if again == nil || text(again["epoch"]) != text(head["epoch"]) || text(again["gen"]) != text(head["gen"]) || writing {
			continue // a clear ran during the sweep
		}
		if seq, err1 := integer(head["seq"]); err1 == nil {
			if seqAgain, err2 := integer(again["seq"]); err2 != nil || seqAgain < seq {
				continue // the hash went back (Redis restarted from an older snapshot): the sweep mixes both
			}
		}
		after, _ := head["next"].(string)
		if after != "" && streamKey != "" {
			first, err := c.XRangeN(ctx, streamKey, "-", "+", 1).Result()
			if err != nil {
				return nil, "", fmt.Errorf("%s: %w", streamKey, err)
			}
			if len(first) > 0 {
				p, err1 := EntryPosition(first[0].ID)
				h, err2 := EntryPosition(after)
				if err1 == nil && err2 == nil && h.Less(p) {
					continue // trimmed past the head: entries after it may be gone
				}
			}
		}
		var docs []Record
		for f, v := range fields {
			if strings.Contains(f, "/") {
				if d, err := Decode([]byte(v)); err == nil {
					docs = append(docs, d)
				}
			}
		}
		state, err := Swept(head, docs, againRaw == raw) // (one script call writes entries and head)
		if err != nil {
			return nil, "", fmt.Errorf("%s: %w", stateKey, err)
		}
		return state, after, nil
	}
	return nil, "", fmt.Errorf("%s: the state was cleared, or its stream trimmed past its head, during each of %d sweeps", stateKey, attempts)
}

// RedisOptions says which streams FollowRedis reads.
type RedisOptions struct {
	Match     string        // SCAN pattern of the bridge's stream keys (its stream template, wildcarded)
	Bootstrap string        // when set: the suffix that makes a stream key its state key (state.key), e.g. ":state"
	Rescan    time.Duration // how often to look for new stream keys
	Block     time.Duration // XREAD BLOCK
}

// FollowRedis applies every entry of the streams matching opts.Match to x until ctx is done
// (each stream from its state with opts.Bootstrap, else from its first entry), calling changed
// between reads (at least every opts.Block). It returns ctx's error, or the first Redis error.
func FollowRedis(ctx context.Context, c redis.UniversalClient, x *Index, opts RedisOptions, changed func()) error {
	last := map[string]string{} // stream key -> last entry id read
	var keys []string
	var scanned time.Time
	for ctx.Err() == nil {
		if time.Since(scanned) > opts.Rescan {
			iter := c.ScanType(ctx, 0, opts.Match, 1000, "stream").Iterator()
			for iter.Next(ctx) {
				key := iter.Val()
				if _, ok := last[key]; ok {
					continue
				}
				start := "0-0"
				if opts.Bootstrap != "" {
					state, after, err := BootstrapRedis(ctx, c, key+opts.Bootstrap, key, 5)
					if err != nil {
						return err
					}
					if after != "" {
						source, _ := state.Head["source"].(string)
						rank, _ := integer(state.Head["dp_rank"])
						x.Seed(Stream{source, rank}, state)
						start = after
					}
				}
				last[key] = start
				keys = append(keys, key)
			}
			if err := iter.Err(); err != nil && ctx.Err() == nil {
				return fmt.Errorf("SCAN %s: %w", opts.Match, err)
			}
			scanned = time.Now()
		}
		if len(keys) == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(opts.Block):
			}
			continue
		}
		args := append([]string{}, keys...)
		for _, k := range keys {
			args = append(args, last[k])
		}
		reply, err := c.XRead(ctx, &redis.XReadArgs{Streams: args, Count: 5000, Block: opts.Block}).Result()
		changed()
		if errors.Is(err, redis.Nil) || ctx.Err() != nil {
			continue
		} else if err != nil {
			return fmt.Errorf("XREAD: %w", err)
		}
		for _, stream := range reply {
			for _, m := range stream.Messages {
				last[stream.Stream] = m.ID
				data, ok := m.Values["data"].(string) // json bodies (raw sinks write 'payload' instead)
				if !ok {
					continue
				}
				r, err := Decode([]byte(data))
				if err != nil {
					return fmt.Errorf("%s %s: %w", stream.Stream, m.ID, err)
				}
				if err := x.Apply(r); err != nil {
					return fmt.Errorf("%s %s: %w", stream.Stream, m.ID, err)
				}
			}
		}
	}
	return ctx.Err()
}
