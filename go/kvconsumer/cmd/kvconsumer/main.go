// Command kvconsumer keeps a KV block index from kv-event-bridge's Redis streams or Kafka topic
// (format: json) and prints it when it changes: the Go counterpart of examples/consumers/.
//
//	kvconsumer redis --url redis://localhost:6379/0 --match 'kv:*' [--bootstrap :state]
//	kvconsumer kafka --brokers localhost:9092 --topic kv-events [--bootstrap kv-state]
//
// --json prints the whole index as one JSON line instead of the summary (tests, small setups).
// Ctrl-C (or SIGTERM) stops it: it prints the index a last time and exits 0.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kv-event-bridge/kv-event-bridge/go/kvconsumer"
)

func main() {
	if len(os.Args) < 2 || (os.Args[1] != "redis" && os.Args[1] != "kafka") {
		fmt.Fprintln(os.Stderr, "usage: kvconsumer redis|kafka [options] (kvconsumer redis -h for the options)")
		os.Exit(2)
	}
	broker := os.Args[1]
	fs := flag.NewFlagSet("kvconsumer "+broker, flag.ExitOnError)
	url := fs.String("url", "redis://localhost:6379/0", "redis: the Redis URL")
	match := fs.String("match", "kv:*", "redis: SCAN pattern of the bridge's stream keys")
	brokers := fs.String("brokers", "localhost:9092", "kafka: bootstrap servers, comma-separated")
	topic := fs.String("topic", "kv-events", "kafka: the sink's topic")
	boot := fs.String("bootstrap", "", "start each stream from its state (the sink's state.enabled): redis: the state key suffix (:state); kafka: the state topic (kv-state)")
	asJSON := fs.Bool("json", false, "print the whole index as one JSON line (hashes exact) instead of the summary")
	every := fs.Duration("every", time.Second, "print the index this often, when it changed")
	seconds := fs.Duration("for", 0, "stop after this long (0: until Ctrl-C)")
	_ = fs.Parse(os.Args[2:])

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *seconds > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *seconds)
		defer cancel()
	}
	x := kvconsumer.NewIndex()
	printed := ""
	show := func(force bool) {
		var out string
		if *asJSON {
			b, err := x.Snapshot()
			if err != nil {
				fmt.Fprintln(os.Stderr, "kvconsumer:", err)
				return
			}
			out = string(b)
		} else {
			out = x.Summary()
		}
		if out != printed || force {
			fmt.Println(out)
			printed = out
		}
	}
	var shown time.Time
	changed := func() { // called by the follower between reads: the index is not being changed
		if time.Since(shown) >= *every {
			show(false)
			shown = time.Now()
		}
	}

	var err error
	switch broker {
	case "redis":
		opts, perr := redis.ParseURL(*url)
		if perr != nil {
			fmt.Fprintf(os.Stderr, "kvconsumer: --url %q: %v\n", *url, perr)
			os.Exit(2)
		}
		opts.DialTimeout, opts.ReadTimeout = 5*time.Second, 10*time.Second
		client := redis.NewClient(opts)
		defer client.Close()
		err = kvconsumer.FollowRedis(ctx, client, x, kvconsumer.RedisOptions{Match: *match, Bootstrap: *boot, Rescan: 2 * time.Second, Block: 200 * time.Millisecond}, changed)
	case "kafka":
		err = kvconsumer.FollowKafka(ctx, x, kvconsumer.KafkaOptions{Brokers: strings.Split(*brokers, ","), Topic: *topic, StateTopic: *boot, Settle: 2 * time.Second}, changed)
	}
	show(true)
	if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		fmt.Fprintln(os.Stderr, "kvconsumer:", err)
		os.Exit(1)
	}
}
