package kvconsumer

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// The bridge's two entry id layouts (connectors/redis.py entry_id), as the Python consumer reads them.
func TestEntryPositionReadsBothLayouts(t *testing.T) {
	cases := []struct {
		id   string
		want Pos
	}{
		{"1099511627777-0", Pos{1, 1, 0}},                             // narrow: epoch 1, seq 0
		{"1110506744053760-18446744073709551615", Pos{1010, 0, Last}}, // narrow EventsLost at slot 0
		{"9225168036854775808-704643075", Pos{1796000000000000, 42, 3}},
		{"9225168036854775808-721420287", Pos{1796000000000000, 42, Last}}, // wide: the slot's last
	}
	for _, c := range cases {
		got, err := EntryPosition(c.id)
		if err != nil || got != c.want {
			t.Errorf("EntryPosition(%q) = %v, %v; want %v", c.id, got, err, c.want)
		}
	}
	a, _ := EntryPosition("1110506744053760-5")
	b, _ := EntryPosition("9225168036854775808-0")
	if !a.Less(b) {
		t.Errorf("a narrow id must sort below every wide one")
	}
}

// afterFirstHScan runs fn once, right after the client's first HSCAN answered.
type afterFirstHScan struct {
	fn   func()
	done bool
}

func (h *afterFirstHScan) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *afterFirstHScan) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if cmd.Name() == "hscan" && !h.done {
			h.done = true
			h.fn()
		}
		return err
	}
}

func (h *afterFirstHScan) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// breaker88 B4: Redis restarted from an older snapshot during a consumer's sweep. The head read
// again had the same (epoch, gen), only an older seq; taking the sweep mixed the newer head with
// entries of both states. A head gone back makes the sweep start over, on the older state.
func TestBootstrapRedisStartsOverWhenTheHeadWentBackMidSweep(t *testing.T) {
	server := miniredis.RunT(t)
	const key = "a:0:state"
	head := func(seq, live int) string {
		b, _ := json.Marshal(map[string]any{"source": "a", "dp_rank": 0, "epoch": 1, "gen": 1, "seq": seq, "live": live, "complete": true})
		return string(b)
	}
	fill := func(from, to, seq int) {
		for b := from; b < to; b++ {
			doc, _ := json.Marshal(map[string]any{"epoch": 1, "gen": 1, "seq": seq, "block": fmt.Sprintf("%016x", b), "medium": "GPU", "count": 1})
			server.HSet(key, fmt.Sprintf("GPU//%016x", b), string(doc))
		}
	}
	older := func() {
		server.Del(key)
		fill(0, 300, 10)
		server.HSet(key, "_head", head(10, 300))
	}
	older()
	fill(300, 350, 20) // the newer state: 50 more blocks at seq 20
	server.HSet(key, "_head", head(20, 350))

	client := redis.NewClient(&redis.Options{Addr: server.Addr()})
	defer client.Close()
	client.AddHook(&afterFirstHScan{fn: older})
	state, _, err := BootstrapRedis(context.Background(), client, key, "", 3)
	if err != nil {
		t.Fatal(err)
	}
	seq, _ := integer(state.Head["seq"])
	if seq != 10 || len(state.Entries) != 300 || !state.Complete {
		t.Errorf("bootstrap: head seq %d, %d entries, complete %v; want 10, 300, true (the older state, swept again)", seq, len(state.Entries), state.Complete)
	}
}
