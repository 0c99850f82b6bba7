// Contends for a lock with Apache Curator's InterProcessMutex, for fencelock's interop
// test. Each round: acquire, read the holder node's czxid (the token fencelock would
// give), check it against the shared register "maxToken:count" and write back
// "token:count+1" with a version check (a concurrent holder would make it fail), release.
//
// Usage: CuratorContender CONNECT_STRING LOCK_PATH REGISTER_PATH ROUNDS
import java.util.Comparator;
import java.util.List;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;
import org.apache.zookeeper.data.Stat;

public class CuratorContender {
    public static void main(String[] args) throws Exception {
        String connect = args[0];
        String lockPath = args[1];
        String register = args[2];
        int rounds = Integer.parseInt(args[3]);
        CuratorFramework client =
                CuratorFrameworkFactory.newClient(connect, 10000, 5000, new RetryNTimes(3, 100));
        client.start();
        client.blockUntilConnected();
        InterProcessMutex mutex = new InterProcessMutex(client, lockPath);
        System.out.println("READY");
        System.out.flush();
        for (int i = 0; i < rounds; i++) {
            mutex.acquire();
            try {
                List<String> children = client.getChildren().forPath(lockPath);
                children.sort(Comparator.comparing(s -> s.substring(s.lastIndexOf("lock-") + 5)));
                Stat holder = client.checkExists().forPath(lockPath + "/" + children.get(0));
                long token = holder.getCzxid();
                Stat stat = new Stat();
                String[] value = new String(client.getData().storingStatIn(stat).forPath(register)).split(":");
                long max = Long.parseLong(value[0]);
                long count = Long.parseLong(value[1]);
                if (token < max) {
                    System.out.println("STALE " + token + " < " + max);
                    System.exit(3);
                }
                Thread.sleep(2);
                client.setData().withVersion(stat.getVersion())
                        .forPath(register, (token + ":" + (count + 1)).getBytes());
                System.out.println("OK " + token);
                System.out.flush();
            } finally {
                mutex.release();
            }
        }
        client.close();
        System.out.println("DONE");
    }
}
